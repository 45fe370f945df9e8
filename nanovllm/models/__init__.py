"""Model definitions, built from the data-plane layers."""
