"""Requests and their state: sampling, generation loops, and (later) the batching scheduler."""
