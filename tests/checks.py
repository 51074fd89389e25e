"""Checks several attention kinds' tests share: a module's output and every gradient against a float64
statement of it, and compiled decoding through a static KV cache against the full forward."""

import torch


def assert_matches_float64(module, x, out, x64, expected, weights, tol=1e-5):
    """``out = module(x)`` against ``expected``, the float64 statement computed from ``x64`` and
    ``weights`` (float64 leaves named as ``module``'s parameters): the output within ``tol``, then the
    gradients of x and of every parameter for one random output gradient, within ``tol`` relative to
    the largest expected gradient (at least 1)."""
    assert out.shape == x.shape and (out.double() - expected).abs().max().item() < tol
    grad_out = torch.randn(out.shape)
    out.backward(grad_out)
    expected.backward(grad_out.double())
    grads = {"x": (x.grad, x64.grad), **{name: (p.grad, weights[name].grad) for name, p in module.named_parameters()}}
    for name, (got, want) in grads.items():
        err = (got.double() - want).abs().max().item()
        assert err < tol * max(1.0, want.abs().max().item()), f"grad {name}: {err}"


def compiled_decoding_error(model, prompt: int = 8, total: int = 14) -> float:
    """The largest logit difference between a full forward of 2 random sequences of ``total`` tokens and
    eager prefill of ``prompt`` tokens then one-token steps of ``model`` compiled without dynamic
    shapes through a static cache: the first step compiles, and a recompilation at any later step is
    an error (one graph serves every step)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    tokens = torch.randint(0, model.config.vocab_size, (2, total))
    with torch.no_grad():
        full, _ = model(tokens)
        cache = model.new_cache(2, total + 2, static=True)
        pieces = [model(tokens[:, :prompt], cache=cache)[0], compiled(tokens[:, prompt : prompt + 1], cache=cache)[0]]
        with torch._dynamo.config.patch(error_on_recompile=True):
            pieces += [compiled(tokens[:, i : i + 1], cache=cache)[0] for i in range(prompt + 1, total)]
    assert cache.length == total
    return (torch.cat(pieces, dim=1) - full).abs().max().item()
