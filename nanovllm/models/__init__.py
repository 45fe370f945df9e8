"""Model definitions built from the data-plane layers, the registry of architectures,
checkpoint loading (loader.py) and the offline demo checkpoints (demo.py)."""
