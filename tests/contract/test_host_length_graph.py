"""A decode graph that takes the cache length as a host int (hf_tpu.transformers' ``HostLengthLayer``, for models
whose code reads their length as a number) reaches torch-tpu 0.2.0's backend the way its dynamic compiler takes it:
one SymInt input, bounded above by the cache bucket (torch-tpu sizes the program for that bound; an unbounded symbol
would get twice its first value, and a longer sequence would not fit). Traced here as dynamo traces it for the
backend; compiling the program needs a chip."""

import torch
from torch_tpu._internal.compile import _backend, compiler
from torch_tpu._internal.compile.dynamic import dynamic_compiler, symbol_bounds

from hf_tpu.transformers._cache.layer_classes import HostLengthLayer
from hf_tpu.transformers._graphs import _HOST_LENGTH_SOURCES


def _traced_inputs(bucket: int, lengths: list[int]) -> list:
    seen: list = []

    def capture(gm, example_inputs):
        seen.append(list(example_inputs))
        return gm.forward

    def step(x, layer):  # what RoFormer does with its length: positions from it
        length = layer.get_seq_length()
        return x + torch.arange(length, length + x.shape[0])

    compiled = torch.compile(step, backend=capture, dynamic=False, fullgraph=True)
    layer = HostLengthLayer(max_cache_len=bucket)
    with torch.compiler.config.patch(dynamic_sources=_HOST_LENGTH_SOURCES):
        for n in lengths:
            layer.hf_tpu_length = n
            assert torch.equal(compiled(torch.zeros(1, dtype=torch.long), layer), torch.tensor([n]))
    return seen


def test_the_length_is_one_symint_bounded_by_the_bucket_and_takes_the_dynamic_compiler():
    torch._dynamo.reset()
    graphs = _traced_inputs(64, [17, 18, 40])
    assert len(graphs) == 1  # one graph for every length
    (inputs,) = graphs
    assert compiler.has_dynamic_symints(inputs)
    (length,) = [a for a in inputs if isinstance(a, torch.SymInt)]
    assert symbol_bounds.get_symint_bounds(length)[1] == 64
    chosen = _backend.make_backend_compiler(inputs)
    assert isinstance(chosen.base_compiler, dynamic_compiler.DynamicCompiler)
    assert torch._dynamo.config.assume_static_by_default  # the backend refuses dynamic=True, not this
