"""The math of one forward step over a batch of positions, with slow reference twins."""
