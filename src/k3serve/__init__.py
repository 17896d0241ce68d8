"""k3serve: CPU inference and serving for sparse Mixture-of-Experts models of the Kimi K3 family."""

__version__ = "0.1.0"
