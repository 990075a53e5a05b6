"""What plugs vjpgen into torch: the ``vjpgen`` torch.compile backend, compiled autograd's kernels, the
fused optimizer step, TorchScript's per-op nodes."""
