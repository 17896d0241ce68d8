"""Training K3 models in torch (optional: imported only by `python -m k3serve.training.train` and its tests).

The serving runtime never imports this package, so torch stays a training/test dependency only.
"""
