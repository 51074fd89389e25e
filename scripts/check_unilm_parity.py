"""Compare attention_from_unilm with the authors' own modules, from a checkout of microsoft/unilm.

    git clone https://github.com/microsoft/unilm   # not vendored here
    python scripts/check_unilm_parity.py --unilm unilm/Diff-Transformer

Their files import a Triton rotary kernel and flash-attn, which need a GPU. On CPU this script
puts stand-ins on the import path: an interleaved rotary in torch and a flash_attn_func over
torch SDPA (layout (B, T, heads, d), causal, GQA). The modules checked are MultiheadDiffAttn
(naive; MHA only, since it pairs keys differently under GQA), MultiheadFlashDiff1 and
MultiheadFlashDiff2, for every backend of this project. Prints the max |difference| per case.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

STAND_INS = {
    "kernel/__init__.py": "",
    "kernel/rotary.py": """
        import torch

        def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False):
            assert interleaved, "the official modules use interleaved rotary"
            t = x.shape[1]
            c, s = cos[:t, None, :].float(), sin[:t, None, :].float()
            even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
            return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).type_as(x)
    """,
    "flash_attn.py": """
        import torch.nn.functional as F

        def flash_attn_func(q, k, v, causal=False):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
            return out.transpose(1, 2)
    """,
}
STAND_INS["flex_head_fa.py"] = STAND_INS["flash_attn.py"]

# (embed_dim, depth, DIFF heads, KV heads or None, rope θ, length)
CASES = [(256, 0, 4, None, 1e4, 33), (256, 5, 4, 2, 1e4, 50), (384, 3, 3, 1, 5e5, 17), (512, 11, 4, 4, 1e4, 64)]


def rel_pos(t: int, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq[None]
    return angles.cos(), angles.sin()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--unilm", required=True, type=Path, help="the Diff-Transformer folder of a unilm checkout")
    args = parser.parse_args()
    if not (args.unilm / "multihead_diffattn.py").is_file():
        parser.error(f"{args.unilm} has no multihead_diffattn.py; pass the Diff-Transformer folder")

    from diff_transformer.interop.unilm import attention_from_unilm

    stand_in_dir = Path(tempfile.mkdtemp(prefix="unilm-stand-ins-"))
    for name, text in STAND_INS.items():
        (stand_in_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (stand_in_dir / name).write_text(textwrap.dedent(text))
    sys.path[:0] = [str(stand_in_dir), str(args.unilm)]
    from multihead_diffattn import MultiheadDiffAttn
    from multihead_flashdiff_1 import MultiheadFlashDiff1
    from multihead_flashdiff_2 import MultiheadFlashDiff2

    torch.manual_seed(0)
    worst = 0.0
    for official_class in (MultiheadDiffAttn, MultiheadFlashDiff1, MultiheadFlashDiff2):
        for embed_dim, depth, heads, kv_heads, theta, t in CASES:
            if official_class is MultiheadDiffAttn and kv_heads not in (None, heads):
                continue
            official = official_class(embed_dim, depth, heads, kv_heads)
            with torch.no_grad():
                official.subln.weight.normal_(1.0, 0.2)
            ours = attention_from_unilm(
                official.state_dict(), embed_dim=embed_dim, depth=depth, num_heads=heads,
                num_kv_heads=kv_heads, rope_theta=theta,
            )
            x = torch.randn(2, t, embed_dim)
            with torch.no_grad():
                expected = official(x, rel_pos(t, embed_dim // heads // 2, theta))
                for backend in ("reference", "sdpa", "sdpa_split"):
                    ours.backend = backend
                    err = (ours(x) - expected).abs().max().item()
                    worst = max(worst, err)
                    print(f"{official_class.__name__:20} E={embed_dim} depth={depth} H={heads} Hkv={kv_heads} "
                          f"θ={theta:g} T={t} {backend:10} max|diff| {err:.2e}")
    print(f"worst max|diff| {worst:.2e}")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
