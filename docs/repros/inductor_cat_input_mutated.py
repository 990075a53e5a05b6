"""Inductor (CPU, torch 2.13): a cat input that a later functional index_put scatters into is
written into the cat's buffer, and the scatter, reinplaced, writes into the cat's output.

    h = x * 2
    c = torch.cat([h, a], 1)                        # wrong: rows of h get the scatter's sums
    s = h.index_put((idx,), src, accumulate=True)   # right

Cause: `ConcatKernel.create` (torch/_inductor/ir.py) realizes each input straight into a slice of
the cat's buffer where it can (`can_realize_into_without_copy`: a buffer with a flexible layout):
`h`'s buffer becomes a view of `c`'s (`NonOwningLayout`). Inductor's reinplacing pass
(torch/_inductor/fx_passes/reinplace.py) sees no reader of `h` after the index_put and turns it
into `index_put_(h, ...)`; the FX graph has no aliasing between `h` and `c`, so nothing stops it.
The scatter then accumulates into `c`. The same with `torch.zeros(20, 16)` as `h`, in training
graphs too, and with two separate `zeros` of one shape (the partitioner's CSE merges them). It was
found in one of schnetpack PaiNN's graphs (0.23 off at a scale of 0.07). Pytorch issue 177821 is
the other side of it: a cat *result* mutated in place, read through an input.

    python inductor_cat_input_mutated.py

apply_fix() copies into the cat every input whose storage the graph writes in place (freezing its
layout first, so it is not realized into the cat's buffer); vjpgen does the same for the graphs it
compiles (vjpgen/runtime/compile/inductor_fixes.py, "cat_input_mutated").
"""
import torch
import torch._inductor.config as cfg

torch.set_num_threads(1)
cfg.fx_graph_cache = False  # so the monkeypatch below is not hidden by a cached compile


def f(idx, src, x, a):
    h = x * 2
    c = torch.cat([h, a], 1)
    s = h.index_put((idx,), src, accumulate=True)
    return c, s


def inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 20, (120,), generator=g), torch.randn(120, 16, generator=g),
            torch.randn(20, 16, generator=g), torch.randn(20, 16, generator=g))


def run(label):
    torch._dynamo.reset()
    args = inputs()
    ref = f(*args)
    out = torch.compile(f, fullgraph=True)(*args)
    print(f"{label:10s} max|compiled - eager|: cat {(out[0] - ref[0]).abs().max().item():.3g}, "
          f"index_put {(out[1] - ref[1]).abs().max().item():.3g}", flush=True)


def apply_fix():
    """Monkeypatch: a cat input whose storage an op of the graph writes in place gets a buffer of
    its own (a fixed layout), so the cat copies it instead of aliasing it."""
    import torch._inductor.ir as ir
    from torch._inductor.virtualized import V
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(n):
        v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
        return StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None

    orig = ir.ConcatKernel.create.__func__

    def create(cls, inputs, dim):
        node = V.graph.current_node
        if node.target is torch.ops.aten.cat.default:
            written = set()
            for n in node.graph.nodes:
                schema = getattr(n.target, "_schema", None)
                for i, arg in enumerate(schema.arguments if schema is not None else ()):
                    if arg.alias_info is not None and arg.alias_info.is_write and i < len(n.args):
                        written.add(storage(n.args[i]))
            for a, x in zip(node.args[0], inputs):
                if storage(a) in written and isinstance(x, ir.TensorBox) and isinstance(x.data, ir.StorageBox):
                    x.realize()
                    x.freeze_layout()
        return orig(cls, inputs, dim)

    ir.ConcatKernel.create = classmethod(create)


if __name__ == "__main__":
    run("inductor")
    apply_fix()
    run("fixed")
