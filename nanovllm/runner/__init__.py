"""The data plane's driver: batch -> tensors, the model on the device, sampling, graphs."""
