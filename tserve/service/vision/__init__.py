"""Serving image classifiers (ViT): the served model and attention maps drawn over the image."""
