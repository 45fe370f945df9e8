"""The data plane's driver: turns a scheduled batch into tensors, runs the model on the
device, samples; plus weight loading, CUDA graphs and tensor-parallel workers."""
