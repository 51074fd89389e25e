"""What the fused kernels take, apart from the kernels themselves (which import Triton): read by the
backend choice in ``ops`` and by ``triton_diff`` alike."""

TRITON_HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # d the fused Triton kernel takes (96: padded to 128 inside)
