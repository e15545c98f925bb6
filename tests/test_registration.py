"""Dispatcher registration: opcheck (schema, fake kernels, autograd registration), gradcheck, torch.compile, the
build information, and the version guard on import."""

import importlib
import os
import subprocess
import sys
import types

import pytest
import torch

from functools import partial

import lmk_ops
from lmk_ops import _loader
from devices import DEVICES, on
from parity import OPS

ops = torch.ops.lmk_ops


def _inputs(dtype=torch.float32, requires_grad=True, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 13, generator=gen, dtype=dtype).to(device).requires_grad_(requires_grad)
    mask = torch.tensor([[1] * 11, [1] * 4 + [0] * 7, [0] * 11], device=device)
    return hidden, mask


# The landmark layouts of _inputs' 3 x 11 batch: a bool mask, and positions with a repeat, -1 and an empty row.
LANDMARK_MASK = torch.tensor([[0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0], [0] * 11]).bool()
POSITIONS = torch.tensor([[2, 5, 10, -1], [1, -1, 1, 3], [-1, -1, -1, -1]])
QUERY = torch.randn(13, generator=torch.Generator().manual_seed(1))

# Every public function as f(hidden, second_argument), with the argument kinds it is checked with.
FUNCTIONS = {
    "mean_pool": (lmk_ops.mean_pool, "mask"),
    "mean_pool+normalize": (partial(lmk_ops.mean_pool, normalize=True), "mask"),
    "max_pool": (lmk_ops.max_pool, "mask"),
    "max_pool+normalize": (partial(lmk_ops.max_pool, normalize=True), "mask"),
    "landmark_mean": (lmk_ops.landmark_mean, "landmarks"),
    "landmark_mean+normalize": (partial(lmk_ops.landmark_mean, normalize=True), "landmarks"),
    "landmark_gather": (lambda h, lm: lmk_ops.landmark_gather(h, lm)[0], "positions"),
    "first_token_pool": (lmk_ops.first_token_pool, "mask"),
    "last_token_pool": (lmk_ops.last_token_pool, "mask"),
    "attention_pool": (lambda h, m: lmk_ops.attention_pool(h, m, QUERY.to(h.device, h.dtype)), "mask"),
}
SECOND_ARGUMENTS = {
    "mask": {"mask": lambda: _inputs()[1], "no mask": lambda: None},
    "landmarks": {"landmark mask": lambda: LANDMARK_MASK, "positions": lambda: POSITIONS},
    "positions": {"positions": lambda: POSITIONS},
}
CASES = [(name, kind) for name, (_, arg) in FUNCTIONS.items() for kind in SECOND_ARGUMENTS[arg]]


def _case(name, kind, dtype=torch.float32, device="cpu"):
    fn, arg = FUNCTIONS[name]
    return fn, _inputs(dtype, device=device)[0], on(device, SECOND_ARGUMENTS[arg][kind]())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["none", "int", "bool"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_pooling_ops(dtype, mask_kind, normalize, device):
    hidden, mask = _inputs(dtype, device=device)
    mask = {"none": None, "int": mask, "bool": mask.bool()}[mask_kind]
    torch.library.opcheck(ops.mean_pool.default, (hidden, mask, normalize))
    torch.library.opcheck(ops.max_pool.default, (hidden, mask, normalize))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_landmark_ops(dtype, normalize, device):
    hidden, _ = _inputs(dtype, device=device)
    for landmarks in (LANDMARK_MASK, POSITIONS):
        torch.library.opcheck(ops.landmark_mean.default, (hidden, landmarks.to(device), normalize))
    torch.library.opcheck(ops.landmark_gather.default, (hidden, POSITIONS.to(device)))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_backward_ops(device):
    hidden, mask = _inputs(device=device)
    grad = torch.randn(3, 13, device=device, requires_grad=True)
    landmark_mask, positions = LANDMARK_MASK.to(device), POSITIONS.to(device)
    torch.library.opcheck(ops.mean_pool_backward.default, (grad, mask, 11))
    torch.library.opcheck(ops.mean_pool_backward.default, (grad, None, 11, torch.bfloat16))
    _, argmax, _ = ops.max_pool(hidden.detach(), mask)
    torch.library.opcheck(ops.max_pool_backward.default, (grad, argmax, 11))
    for landmarks in (landmark_mask, positions):
        torch.library.opcheck(ops.landmark_mean_backward.default, (grad, landmarks, 11))
    torch.library.opcheck(ops.landmark_mean_backward.default, (grad, positions, 11, torch.float16))
    gathered_grad = torch.randn(3, 4, 13, device=device, requires_grad=True)
    torch.library.opcheck(ops.landmark_gather_backward.default, (gathered_grad, positions, 11))


@pytest.mark.parametrize("name,kind", CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_gradients_are_wired(name, kind, device):
    # A missing autograd registration leaves .grad None while opcheck still passes: check it directly.
    fn, hidden, arg = _case(name, kind, device=device)
    (fn(hidden, arg) * torch.randn(fn(hidden, arg).shape, device=device)).sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


@pytest.mark.parametrize("name,kind", CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_eager_calls_take_lmk_ops_autograd_function_or_skip_autograd(name, kind, device, monkeypatch):
    # The public functions call an op through lmk_ops' own autograd.Function when an input requires grad (past
    # the dispatcher's Python autograd kernel), and below autograd when nothing does or grad mode is off: the same
    # values either way. The Function's forward is the one call below autograd of a tracked call.
    below = []  # the calls lmk_ops made below autograd (its dispatcher kernel goes there too)
    real = torch._C._AutoDispatchBelowAutograd

    class Spy(real):
        def __enter__(self):
            if sys._getframe(1).f_globals["__name__"].startswith("lmk_ops"):
                below.append(True)
            return super().__enter__()

    monkeypatch.setattr(torch._C, "_AutoDispatchBelowAutograd", Spy)
    fn, hidden, arg = _case(name, kind, device=device)
    tracked = fn(hidden, arg)
    assert tracked.requires_grad and len(below) == 1
    assert "Dispatched" not in type(tracked.grad_fn).__name__  # not the dispatcher's kernel
    with torch.no_grad():
        untracked = fn(hidden, arg)
    plain = fn(hidden.detach(), arg)
    with torch.inference_mode():
        inference = fn(hidden.detach(), arg)
    assert len(below) == 4
    for out in (untracked, plain, inference):
        assert not out.requires_grad
        assert torch.equal(out, tracked.detach())


@pytest.mark.parametrize("name,kind", CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_eager_and_dispatcher_autograd_give_the_same_bits(name, kind, device, monkeypatch):
    # Eager calls differentiate through lmk_ops' autograd.Function; dynamo and direct torch.ops calls go through the
    # autograd kernel registered with the dispatcher. Both wrap the same setup_context and backward: the same
    # output, gradient and double-backward bits.
    fn, hidden, arg = _case(name, kind, torch.float64, device)

    def run():
        h = hidden.detach().requires_grad_()
        out = fn(h, arg)
        up = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype).to(device)
        up.requires_grad_()
        (g,) = torch.autograd.grad(out, h, up, create_graph=True)
        gg = torch.autograd.grad((g * g).sum(), (h, up), allow_unused=True)
        return type(out.grad_fn).__name__, [out, g, *gg]

    eager_route, eager = run()
    monkeypatch.setattr(lmk_ops._dispatch, "_is_compiling", lambda: True)  # call() then calls the op as dynamo does
    dispatcher_route, dispatched = run()
    assert dispatcher_route.endswith("DispatchedBackward") and "Dispatched" not in eager_route
    for mine, theirs in zip(eager, dispatched):
        assert (mine is None and theirs is None) or torch.equal(mine, theirs)


def _torch_func_matches_autograd(f, hidden, generator):
    """torch.func.vjp, grad of grad, jacrev and torch.vmap over grad of f give torch.autograd's bits; jacfwd (the
    ops' forward-mode rules, under torch.vmap) its Jacobian."""
    out, pullback = torch.func.vjp(f, hidden)
    up = torch.randn(out.shape, generator=generator, dtype=out.dtype).to(out.device)
    h = hidden.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(h), h, up.clone().requires_grad_(), create_graph=True)  # (g needs a graph)
    (gg,) = torch.autograd.grad((g * g).sum(), h, materialize_grads=True)  # zeros where f is linear
    assert torch.equal(pullback(up)[0], g)
    assert torch.equal(torch.func.grad(lambda x: (torch.func.vjp(f, x)[1](up)[0] ** 2).sum())(hidden), gg)
    jacobian = torch.autograd.functional.jacobian(f, hidden)
    assert torch.equal(torch.func.jacrev(f)(hidden), jacobian)
    torch.testing.assert_close(torch.func.jacfwd(f)(hidden), jacobian)
    stack = torch.stack([hidden, 2 * hidden, -hidden])
    per_slice = torch.func.vmap(torch.func.grad(lambda x: (f(x) * up).sum()))(stack)
    slices = [x.clone().requires_grad_() for x in stack]
    assert torch.equal(per_slice, torch.stack([torch.autograd.grad(f(x), x, up)[0] for x in slices]))


@pytest.mark.parametrize("name,kind", CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_gives_autograds_results(name, kind, device):
    # Inside torch.func's transforms the public functions differentiate through a third Function of the same
    # setup_context and backward, one that the transforms take (_dispatch.call); the backward ops have vmap rules.
    fn, hidden, arg = _case(name, kind, torch.float64, device)
    _torch_func_matches_autograd(lambda h: fn(h, arg), hidden.detach(), torch.Generator().manual_seed(4))


PACKED_FUNCTIONS = {
    "mean_pool+normalize": lambda h, m, cu: lmk_ops.mean_pool(h, m, normalize=True, cu_seqlens=cu),
    "max_pool": lambda h, m, cu: lmk_ops.max_pool(h, m, cu_seqlens=cu),
    "landmark_mean": lambda h, m, cu: lmk_ops.landmark_mean(h, m, cu_seqlens=cu),
    "landmark_gather": lambda h, m, cu: lmk_ops.landmark_gather(h, m, num_landmarks=3, cu_seqlens=cu)[0],
    "last_token_pool": lambda h, m, cu: lmk_ops.last_token_pool(h, m, cu_seqlens=cu),
    "attention_pool weights": lambda h, m, cu: lmk_ops.attention_pool(
        h, m, QUERY.to(h.device, h.dtype).reshape(1, 13), return_weights=True, cu_seqlens=cu)[1],
}


@pytest.mark.parametrize("name", PACKED_FUNCTIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_over_packed_batches(name, device):
    hidden, mask = _inputs(torch.float64, requires_grad=False, device=device)
    offsets = torch.tensor([0, 11, 15, 15], device=device)  # _inputs' valid rows, packed, and an empty text
    packed, landmarks = hidden[mask.bool()], LANDMARK_MASK.to(device)[mask.bool()]
    valid = landmarks if name.startswith("landmark") else ~landmarks  # the other ops take a mask with gaps
    _torch_func_matches_autograd(lambda h: PACKED_FUNCTIONS[name](h, valid, offsets), packed,
                                 torch.Generator().manual_seed(5))


@pytest.mark.parametrize("name,kind", CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_and_gradgradcheck_float64(name, kind, device):
    # Reverse and forward mode (the ops' jvp rules), and forward over reverse (torch.func.hessian's way).
    fn, hidden, arg = _case(name, kind, torch.float64, device)
    assert torch.autograd.gradcheck(lambda h: fn(h, arg), (hidden,), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(lambda h: fn(h, arg), (hidden,), check_fwd_over_rev=True)


@pytest.mark.parametrize("op", [*OPS, "landmark_mean+normalize"])
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(op, dynamic, device):
    torch._dynamo.reset()  # each case compiles the same code object with another op; keep under the recompile limit
    fn = FUNCTIONS[op][0]

    def model(hidden, mask, weight):
        return torch.nn.functional.normalize(fn(hidden @ weight, mask), dim=-1)

    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)
    weight = torch.randn(13, 13, device=device, requires_grad=True)
    for seq_len in (11, 17):  # a second length exercises the dynamic graph (or a recompile)
        hidden = torch.randn(3, seq_len, 13, device=device, requires_grad=True)
        mask = torch.rand(3, seq_len, device=device) < 0.7
        eager_out = model(hidden, mask, weight)
        eager_grads = torch.autograd.grad(eager_out.square().sum(), (hidden, weight))
        out = compiled(hidden, mask, weight)
        grads = torch.autograd.grad(out.square().sum(), (hidden, weight))
        torch.testing.assert_close(out, eager_out)
        for g, e in zip(grads, eager_grads):
            torch.testing.assert_close(g, e)


@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")  # deprecated, still used to ship models
@pytest.mark.parametrize("name,kind", CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_jit_trace_records_the_ops_and_saves(name, kind, device, tmp_path):
    # Traced with an input that requires grad (a model's states do), the ops must be recorded as themselves, not as
    # lmk_ops' eager autograd.Function (a Python op that fails the trace's check and cannot be saved); the saved
    # module gives the same output and gradient.
    fn, hidden, arg = _case(name, kind, torch.float64, device)
    traced = torch.jit.trace(lambda h: fn(h, arg), (hidden,))
    assert "lmk_ops::" in str(traced.graph) and "PythonOp" not in str(traced.graph)
    torch.jit.save(traced, str(tmp_path / "traced.pt"))
    loaded = torch.jit.load(str(tmp_path / "traced.pt"))
    out, expected = loaded(hidden), fn(hidden, arg)
    assert torch.equal(out, expected)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype).to(device)
    assert torch.equal(torch.autograd.grad(out, hidden, up)[0], torch.autograd.grad(expected, hidden, up)[0])


@pytest.mark.parametrize("name,kind", CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_torch_export_with_a_dynamic_batch(name, kind, device):
    # torch.export traces through the fake kernels; the exported program, run on a batch of another size, gives the
    # eager output and gradient.
    fn, hidden, arg = _case(name, kind, torch.float64, device)

    class Model(torch.nn.Module):
        def forward(self, h, a):
            return fn(h, a)

    batch = torch.export.Dim("batch", min=2)
    exported = torch.export.export(Model(), (hidden, arg), dynamic_shapes=({0: batch}, None if arg is None else
                                                                           {0: batch}))
    assert "lmk_ops." in str(exported.graph)
    double = (torch.cat([hidden, hidden.flip(0)]).detach().requires_grad_(),
              None if arg is None else torch.cat([arg, arg.flip(0)]))
    out, expected = exported.module()(*double), fn(*double)
    assert torch.equal(out, expected)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype).to(device)
    assert torch.equal(torch.autograd.grad(out, double[0], up)[0], torch.autograd.grad(expected, double[0], up)[0])


def test_build_info():
    info = lmk_ops.build_info()
    assert info["min_torch"] == "2.10" and _loader._major_minor(info["torch_version"]) >= (2, 10)
    assert info["version"] == lmk_ops.__version__
    assert info["num_threads"] == torch.get_num_threads()
    assert info["cpu_capability"] in ("DEFAULT", "AVX2", "AVX512")
    assert info["cpu_prefetch"] in ("L1", "L2", "L1 for 16-bit rows, L2 for wider")
    assert isinstance(info["cuda"], bool)
    assert isinstance(info["cpu_twin"], bool)


# Every op whose CPU kernels prefetch (the mean, the maximum, attention with one head and with heads of 64; one long
# text of several chunks and a masked batch), in float32 and bfloat16, saved to the file named by argv[1].
PREFETCHING_OPS = """
import sys, torch, lmk_ops
print(lmk_ops.build_info()["cpu_prefetch"])
gen = torch.Generator().manual_seed(0)
outs = []
for dtype in (torch.float32, torch.bfloat16):
    for hidden, mask in ((torch.randn(1, 9000, 1024, generator=gen), None),
                         (torch.randn(3, 700, 768, generator=gen), torch.rand(3, 700, generator=gen) < 0.8)):
        hidden = hidden.to(dtype)
        dim = hidden.shape[-1]
        outs += [lmk_ops.mean_pool(hidden, mask), lmk_ops.max_pool(hidden, mask)]
        for heads in (1, dim // 64):
            outs.append(lmk_ops.attention_pool(hidden, mask, torch.randn(heads, dim // heads, generator=gen).to(dtype)))
torch.save(outs, sys.argv[1])
"""


def test_the_prefetch_level_follows_the_cpu():
    """Unset, LMK_OPS_PREFETCH leaves the choice to the CPU: L2 on AMD Zen 4 (family 25, models 0x10-0x1F, 0x60-0x7F,
    0xA0-0xAF), L1 for 16-bit rows and L2 for wider ones on Intel, L1 elsewhere; read here from /proc/cpuinfo,
    independently of the extension's CPUID probe."""
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("needs /proc/cpuinfo")
    fields: dict[str, str] = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    if "cpu family" not in fields:
        pytest.skip("/proc/cpuinfo names no x86 family")
    model = int(fields["model"])
    zen4 = (fields.get("vendor_id") == "AuthenticAMD" and int(fields["cpu family"]) == 25
            and (0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF))
    env = {k: v for k, v in os.environ.items() if k != "LMK_OPS_PREFETCH"}
    done = subprocess.run([sys.executable, "-c", "import lmk_ops; print(lmk_ops.build_info()['cpu_prefetch'])"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    intel = fields.get("vendor_id") == "GenuineIntel"
    expected = "L2" if zen4 else "L1 for 16-bit rows, L2 for wider" if intel else "L1"
    assert done.stdout.strip().splitlines()[-1] == expected, fields


def test_the_prefetch_variable_chooses_the_cache_and_never_the_results(tmp_path):
    results = {}
    unset = {k: v for k, v in os.environ.items() if k != "LMK_OPS_PREFETCH"}
    for level in ("l1", "l2", None):  # None: unset (on Intel, L1 for 16-bit rows and L2 for wider)
        path = tmp_path / f"{level}.pt"
        env = unset if level is None else dict(unset, LMK_OPS_PREFETCH=level)
        done = subprocess.run([sys.executable, "-c", PREFETCHING_OPS, str(path)], capture_output=True, text=True,
                              env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        if level is not None:
            assert done.stdout.split()[-1] == level.upper()
        results[level] = torch.load(path)
    assert len(results["l1"]) == 16
    for into_l1, into_l2, chosen in zip(results["l1"], results["l2"], results[None]):
        assert torch.equal(into_l1, into_l2) and torch.equal(into_l1, chosen)


@pytest.mark.parametrize("value", ["L1", "l3", "0", " l2"])
def test_a_prefetch_variable_other_than_l1_or_l2_is_refused_on_import(value):
    with pytest.raises(ValueError, match=f"lmk_ops: expected LMK_OPS_PREFETCH to be 'l1' or 'l2' \\(or unset\\), "
                                         f"got '{value}'"):
        _loader.check_prefetch_variable({"LMK_OPS_PREFETCH": value})
    done = subprocess.run([sys.executable, "-c", "import lmk_ops"], capture_output=True, text=True,
                          env=dict(os.environ, LMK_OPS_PREFETCH=value))
    assert done.returncode != 0 and "expected LMK_OPS_PREFETCH to be 'l1' or 'l2'" in done.stderr, done.stderr[-3000:]
    for fine in ({}, {"LMK_OPS_PREFETCH": ""}, {"LMK_OPS_PREFETCH": "l1"}, {"LMK_OPS_PREFETCH": "l2"}):
        _loader.check_prefetch_variable(fine)


def test_cpu_tensors_take_the_paths_the_build_says():
    """A release build does some bookkeeping on the CPU in plain loops (csrc/common/host_path.h: here the
    normalisation); a CPU-twin build (LMK_OPS_CPU_TWIN, scripts/cpu_twin_check.sh) composes it from tensor
    operations as a CUDA build does, which the profiler sees. The twin run of the suite checks CUDA's op-layer code
    only if this holds."""
    hidden, offsets = torch.randn(10, 8), torch.tensor([0, 3, 10], dtype=torch.int32)
    with torch.no_grad(), torch.profiler.profile() as profiler:
        lmk_ops.mean_pool(hidden, cu_seqlens=offsets, max_seqlen=7, normalize=True)
    composed = {event.name for event in profiler.events() if event.name.startswith("aten::")}
    assert bool(composed) == lmk_ops.build_info()["cpu_twin"], composed


def _build(cuda_version=""):
    return types.SimpleNamespace(TORCH_VERSION="2.13.0+cpu", MIN_TORCH="2.10", CUDA=bool(cuda_version),
                                 CUDA_VERSION=cuda_version)


@pytest.mark.parametrize("torch_version,torch_cuda,cuda_version", [
    ("2.10.0+cpu", None, ""), ("2.13.0", "13.0", ""), ("2.17.1+cu131", "13.1", "13.0"), ("2.11.0", "12.8", "12.6"),
    ("2.14.0a0+git1234", None, ""),
])
def test_the_import_guard_accepts_any_torch_from_the_targeted_one(torch_version, torch_cuda, cuda_version):
    _loader.check_torch(_build(cuda_version), torch_version, torch_cuda)


@pytest.mark.parametrize("torch_version,torch_cuda,cuda_version,expected", [
    ("2.9.1+cpu", None, "", "needs torch >= 2.10"),
    ("2.13.0+cpu", None, "13.0", "is a CPU-only build"),
    ("2.13.0+cu128", "12.8", "13.0", "need torch built for CUDA 13.x"),
])
def test_the_import_guard_names_what_it_found_and_what_it_needs(torch_version, torch_cuda, cuda_version, expected):
    with pytest.raises(ImportError, match="lmk_ops: ") as info:
        _loader.check_torch(_build(cuda_version), torch_version, torch_cuda)
    assert expected in str(info.value) and torch_version in str(info.value)


def test_load_extension_applies_the_guard(monkeypatch):
    build = importlib.import_module("lmk_ops._build_info")
    monkeypatch.setattr(build, "MIN_TORCH", "99.0")
    with pytest.raises(ImportError, match=r"needs torch >= 99\.0.*" + torch.__version__.replace("+", r"\+")):
        _loader.load_extension()


def test_public_api_is_documented():
    for fn in (lmk_ops.mean_pool, lmk_ops.max_pool, lmk_ops.landmark_mean, lmk_ops.landmark_gather,
               lmk_ops.attention_pool):
        assert "Returns" in fn.__doc__ and "Raises" in fn.__doc__ and "{" not in fn.__doc__
    assert "Keys" in lmk_ops.build_info.__doc__ and lmk_ops.landmark_positions.__doc__


def test_import_lmk_ops_alone_gives_every_submodule_the_readme_calls():
    """In a fresh process (this one has imported them all): the README calls lmk_ops.hf and lmk_ops.nn after a bare
    import lmk_ops; lmk_ops.hf was missing until imported by name."""
    script = ("import sys, lmk_ops\n"
              "assert callable(lmk_ops.hf.tokenize_with_landmarks) and callable(lmk_ops.nn.Pooling)\n"
              "assert 'transformers' not in sys.modules and 'sentence_transformers' not in sys.modules\n"
              "assert all(hasattr(lmk_ops, name) for name in lmk_ops.__all__)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_compile_fullgraph_landmark_positions_and_gather():
    def model(hidden, positions):
        vectors, valid = lmk_ops.landmark_gather(hidden, positions)
        return lmk_ops.landmark_mean(hidden, positions, normalize=True), vectors, valid

    hidden = torch.randn(3, 11, 13, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True)
    for got, want in zip(compiled(hidden, POSITIONS), model(hidden, POSITIONS)):
        torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(compiled(hidden, POSITIONS)[1].sum(), hidden)
    torch.testing.assert_close(grads[0], torch.autograd.grad(model(hidden, POSITIONS)[1].sum(), hidden)[0])


# attention_pool inputs: D = 12 (so that 1, 2, 3, 4 and 6 heads fit) and _inputs' mask.
def _attention_inputs(dtype=torch.float32, heads=3, device="cpu"):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 11, 12, generator=gen, dtype=dtype).to(device).requires_grad_()
    query = torch.randn(heads, 12 // heads, generator=gen, dtype=dtype).to(device).requires_grad_()
    return hidden, _inputs(device=device)[1], query


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["none", "int", "bool"])
@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_attention_ops(dtype, mask_kind, return_weights, device):
    hidden, mask, query = _attention_inputs(dtype, device=device)
    mask = {"none": None, "int": mask, "bool": mask.bool()}[mask_kind]
    torch.library.opcheck(ops.attention_pool.default, (hidden, mask, query, None, return_weights))
    torch.library.opcheck(ops.attention_pool.default, (hidden, mask, query[0].repeat(3), 0.7, return_weights))
    out, stats, weights = ops.attention_pool(hidden.detach(), mask, query.detach(), None, True)
    grad = torch.randn(3, 12, dtype=dtype, device=device, requires_grad=True)
    grad_weights = torch.randn_like(weights).requires_grad_() if return_weights else None
    torch.library.opcheck(ops.attention_pool_backward.default,
                          (grad, grad_weights, hidden, mask, query, out, stats, None))


@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_attention_gradcheck_and_gradgradcheck_float64(heads, return_weights, masked, device):
    hidden, mask, query = _attention_inputs(torch.float64, heads, device)
    mask = mask if masked else None
    query = query.detach().flatten().requires_grad_() if heads == 1 else query

    def fn(h, q):
        return lmk_ops.attention_pool(h, mask, q, return_weights=return_weights)

    # Forward mode through the reference too (slower: checked with the mask only).
    assert torch.autograd.gradcheck(fn, (hidden, query), check_forward_ad=masked)
    assert torch.autograd.gradgradcheck(fn, (hidden, query), check_fwd_over_rev=masked)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_gradients_are_wired(device):
    hidden, mask, query = _attention_inputs(device=device)
    out, weights = lmk_ops.attention_pool(hidden, mask, query, return_weights=True)
    (out * torch.randn_like(out)).sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    assert query.grad is not None and query.grad.abs().sum() > 0
    hidden.grad = query.grad = None
    _, weights = lmk_ops.attention_pool(hidden, mask, query, return_weights=True)
    (weights * torch.randn_like(weights)).sum().backward()  # the weights alone carry gradient too
    assert hidden.grad.abs().sum() > 0 and query.grad.abs().sum() > 0


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_attention_compile_fullgraph_matches_eager(dynamic, return_weights, device):
    torch._dynamo.reset()
    weight = torch.randn(12, 12, device=device, requires_grad=True)
    query = torch.randn(4, 3, device=device, requires_grad=True)

    def model(hidden, mask):
        result = lmk_ops.attention_pool(hidden @ weight, mask, query, return_weights=return_weights)
        out = result[0] if return_weights else result
        loss = torch.nn.functional.normalize(out, dim=-1).square().sum()
        return loss + result[1].square().sum() if return_weights else loss

    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)
    for seq_len in (11, 17):
        hidden = torch.randn(3, seq_len, 12, device=device, requires_grad=True)
        mask = torch.rand(3, seq_len, device=device) < 0.7
        eager = model(hidden, mask)
        eager_grads = torch.autograd.grad(eager, (hidden, weight, query))
        got = compiled(hidden, mask)
        grads = torch.autograd.grad(got, (hidden, weight, query))
        torch.testing.assert_close(got, eager)
        for g, e in zip(grads, eager_grads):
            torch.testing.assert_close(g, e)


def test_attention_pooling_module_compiles():
    torch._dynamo.reset()
    module = lmk_ops.nn.AttentionPooling(12, heads=4)
    torch.nn.init.normal_(module.query)
    hidden = torch.randn(3, 11, 12)
    mask = torch.rand(3, 11) < 0.7
    compiled = torch.compile(module, fullgraph=True)
    torch.testing.assert_close(compiled(hidden, attention_mask=mask), module(hidden, attention_mask=mask))


def test_the_package_imports_and_runs_with_docstrings_stripped():
    # python -OO strips docstrings (some deployments run so): ops.py filled placeholders in its docstrings with
    # str.replace on what was then None, and `import lmk_ops` failed; the report's --help read its module docstring.
    script = ("import torch, lmk_ops; assert lmk_ops.mean_pool.__doc__ is None; "
              "out = lmk_ops.mean_pool(torch.ones(1, 2, 3), normalize=True); "
              "print(torch.allclose(out, torch.full((1, 3), 3 ** -0.5)))")
    result = subprocess.run([sys.executable, "-OO", "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True"
    result = subprocess.run([sys.executable, "-OO", "-m", "lmk_ops.bench", "--help"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "--packed" in result.stdout, result.stderr[-2000:]
