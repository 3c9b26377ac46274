"""Nova's passes, IR in and IR out (as xDSL's filecheck tests): parse a module, run the pass, compare the printed
result with the expected module printed the same way."""
import math

import numpy as np
import pytest

from blutrain.nova import ir
from blutrain.nova.dialect import FullOp
from blutrain.nova.graph import literal
from blutrain.nova.passes import PASSES, CanonicalizePass, CSEPass, DCEPass, FoldPass
from blutrain.nova.pipeline import op_counts, optimize

F32, F64, I32, I64 = "f32", "f64", "i32", "i64"


def func(args: str, results: str, body: str) -> str:
  """A module holding `func.func @step(args) -> (results)` with the given body lines."""
  lines = "\n".join("    " + line.strip() for line in body.strip().splitlines())
  return f"builtin.module {{\n  func.func @step({args}) -> ({results}) {{\n{lines}\n  }}\n}}\n"


def printed(module) -> str:
  """The module printed with SSA values numbered in order (the names of the test's text dropped)."""
  for op in module.walk():
    for v in (*op.results, *(a for r in op.regions for b in r.blocks for a in b.args)): v.name_hint = None
  return ir.print_module(module)


def run(passes, text: str) -> str:
  module = ir.parse_module(text)
  for p in passes: p.run(module)
  module.verify()
  return printed(module)


def check(passes, before: str, after: str) -> None:
  assert run(passes, before) == printed(ir.parse_module(after))


def full(name: str, value: str, ty: str, shape: str = "") -> str:
  dims = f"array<i64: {shape}>" if shape else "array<i64>"
  t = f"tensor<{shape.replace(', ', 'x')}x{ty}>" if shape else f"tensor<{ty}>"
  return f"{name} = nova.full {{shape = {dims}, value = {value}, dtype = {ty}}} : {t}"


CANON = (CanonicalizePass(), DCEPass())
X4 = "%x: tensor<4xf32>"


# *** canonicalize ***

@pytest.mark.parametrize("op, const, swapped", [("mul", "1.0 : f64", True), ("add", "0.0 : f64", True),
                                                ("add", "0 : i64", False), ("sub", "0.0 : f64", False),
                                                ("div", "1.0 : f64", False), ("mul", "true", False)])
def test_identities(op, const, swapped):
  x, c = ("%x", "tensor<4xf32>"), ("%c", "tensor<f32>")
  for (a, ta), (b, tb) in [(x, c)] + ([(c, x)] if swapped else []):
    before = func(X4, "tensor<4xf32>", f"""
      {full("%c", const, F32)}
      %y = nova.{op} {a}, {b} : ({ta}, {tb}) -> tensor<4xf32>
      func.return %y : tensor<4xf32>""")
    check(CANON, before, func(X4, "tensor<4xf32>", "func.return %x : tensor<4xf32>"))


@pytest.mark.parametrize("body", [
  # broadcasting grows x: the identity would change the shape
  f"""{full("%c", "1.0 : f64", F32, "2, 4")}
      %y = nova.mul %x, %c : (tensor<4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
      func.return %y : tensor<2x4xf32>""",
  # 1 * x takes the splat's dtype: dropping it would change the dtype
  f"""{full("%c", "1.0 : f64", F64)}
      %y = nova.mul %c, %x : (tensor<f64>, tensor<4xf32>) -> tensor<4xf64>
      func.return %y : tensor<4xf64>""",
  # 0 - x and 1 / x are no identities; neither is x * 2
  f"""{full("%c", "0.0 : f64", F32)}
      %y = nova.sub %c, %x : (tensor<f32>, tensor<4xf32>) -> tensor<4xf32>
      func.return %y : tensor<4xf32>""",
  f"""{full("%c", "1.0 : f64", F32)}
      %y = nova.div %c, %x : (tensor<f32>, tensor<4xf32>) -> tensor<4xf32>
      func.return %y : tensor<4xf32>""",
  f"""{full("%c", "2.0 : f64", F32)}
      %y = nova.mul %x, %c : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>
      func.return %y : tensor<4xf32>""",
])
def test_identities_that_must_not_fire(body):
  module = func(X4, body.strip().splitlines()[-1].split(" : ")[-1], body)
  assert run(CANON, module) == printed(ir.parse_module(module))


def test_neg_neg():
  check(CANON, func(X4, "tensor<4xf32>", """
    %a = nova.neg %x : (tensor<4xf32>) -> tensor<4xf32>
    %b = nova.neg %a : (tensor<4xf32>) -> tensor<4xf32>
    %c = nova.neg %b : (tensor<4xf32>) -> tensor<4xf32>
    func.return %c : tensor<4xf32>"""), func(X4, "tensor<4xf32>", """
    %a = nova.neg %x : (tensor<4xf32>) -> tensor<4xf32>
    func.return %a : tensor<4xf32>"""))


X234 = "%x: tensor<2x3x4xf32>"


def test_permute_of_permute_composes():
  check(CANON, func(X234, "tensor<4x2x3xf32>", """
    %a = nova.permute %x {dims = array<i64: 1, 2, 0>} : (tensor<2x3x4xf32>) -> tensor<3x4x2xf32>
    %b = nova.permute %a {dims = array<i64: 1, 2, 0>} : (tensor<3x4x2xf32>) -> tensor<4x2x3xf32>
    func.return %b : tensor<4x2x3xf32>"""), func(X234, "tensor<4x2x3xf32>", """
    %b = nova.permute %x {dims = array<i64: 2, 0, 1>} : (tensor<2x3x4xf32>) -> tensor<4x2x3xf32>
    func.return %b : tensor<4x2x3xf32>"""))


def test_permute_chain_to_identity():
  check(CANON, func(X234, "tensor<2x3x4xf32>, tensor<2x3x4xf32>", """
    %a = nova.permute %x {dims = array<i64: 1, 2, 0>} : (tensor<2x3x4xf32>) -> tensor<3x4x2xf32>
    %b = nova.permute %a {dims = array<i64: 1, 2, 0>} : (tensor<3x4x2xf32>) -> tensor<4x2x3xf32>
    %c = nova.permute %b {dims = array<i64: 1, 2, 0>} : (tensor<4x2x3xf32>) -> tensor<2x3x4xf32>
    %d = nova.permute %x {dims = array<i64: 0, 1, 2>} : (tensor<2x3x4xf32>) -> tensor<2x3x4xf32>
    func.return %c, %d : tensor<2x3x4xf32>, tensor<2x3x4xf32>"""),
    func(X234, "tensor<2x3x4xf32>, tensor<2x3x4xf32>", "func.return %x, %x : tensor<2x3x4xf32>, tensor<2x3x4xf32>"))


def test_view_of_view():
  check(CANON, func(X234, "tensor<6x4xf32>, tensor<2x3x4xf32>", """
    %a = nova.view %x {shape = array<i64: 24>} : (tensor<2x3x4xf32>) -> tensor<24xf32>
    %b = nova.view %a {shape = array<i64: 6, 4>} : (tensor<24xf32>) -> tensor<6x4xf32>
    %c = nova.view %a {shape = array<i64: 2, 3, 4>} : (tensor<24xf32>) -> tensor<2x3x4xf32>
    func.return %b, %c : tensor<6x4xf32>, tensor<2x3x4xf32>"""), func(X234, "tensor<6x4xf32>, tensor<2x3x4xf32>", """
    %b = nova.view %x {shape = array<i64: 6, 4>} : (tensor<2x3x4xf32>) -> tensor<6x4xf32>
    func.return %b, %x : tensor<6x4xf32>, tensor<2x3x4xf32>"""))


def _sb(name: str, g: str, lo: int, hi: int) -> str:
  return (f"{name} = nova.slice_backward {g} {{shape = array<i64: 4, 6>, index = [array<i64: 0, 4, 1>, "
          f"array<i64: {lo}, {hi}, 1>]}} : (tensor<4x{hi - lo}xf32>) -> tensor<4x6xf32>")


G3 = "%a: tensor<4x2xf32>, %b: tensor<4x2xf32>, %c: tensor<4x2xf32>"


def test_split_gradient_becomes_one_cat():
  """The bands of the slice_backwards tile dim 1 (in any order of the adds): one cat of the gradients by band."""
  check(CANON, func(G3, "tensor<4x6xf32>", f"""
    {_sb("%sa", "%a", 2, 4)}
    {_sb("%sb", "%b", 0, 2)}
    {_sb("%sc", "%c", 4, 6)}
    %t = nova.add %sa, %sb : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
    %u = nova.add %sc, %t : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
    func.return %u : tensor<4x6xf32>"""), func(G3, "tensor<4x6xf32>", """
    %u = nova.cat %b, %a, %c {dim = 1 : i64} : (tensor<4x2xf32>, tensor<4x2xf32>, tensor<4x2xf32>) -> tensor<4x6xf32>
    func.return %u : tensor<4x6xf32>"""))


@pytest.mark.parametrize("other", ["%x", "%z"], ids=["read", "zero"])
def test_split_gradient_inside_a_larger_sum(other):
  """An inner add of a tree of adds whose summands tile the dim becomes the cat; the add above it stays (or, adding
  zero, goes too: the pattern tries the tree's adds before `x + 0` takes its root)."""
  args = f"{G3}, %x: tensor<4x6xf32>"
  add = f"nova.add %t2, {other} : (tensor<4x6xf32>, tensor<{'4x6xf32' if other == '%x' else 'f32'}>) -> tensor<4x6xf32>"
  cat = "nova.cat %a, %b, %c {dim = 1 : i64} : (tensor<4x2xf32>, tensor<4x2xf32>, tensor<4x2xf32>) -> tensor<4x6xf32>"
  check(CANON, func(args, "tensor<4x6xf32>", f"""
    {_sb("%sa", "%a", 0, 2)}
    {_sb("%sb", "%b", 2, 4)}
    {_sb("%sc", "%c", 4, 6)}
    {full("%z", "0.0 : f64", F32)}
    %t1 = nova.add %sa, %sb : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
    %t2 = nova.add %t1, %sc : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
    %u = {add}
    func.return %u : tensor<4x6xf32>"""), func(args, "tensor<4x6xf32>", f"""
    %t2 = {cat}
    {f"%u = {add}" if other == "%x" else ""}
    func.return {"%u" if other == "%x" else "%t2"} : tensor<4x6xf32>"""))


@pytest.mark.parametrize("bands,reuse", [([(0, 2), (2, 4), (2, 4)], False), ([(0, 2), (2, 4), (4, 6)], True)],
                         ids=["overlap-and-gap", "a-part-read-elsewhere"])
def test_split_gradient_needs_a_tiling_read_only_by_the_sum(bands, reuse):
  text = func(G3, "tensor<4x6xf32>, tensor<4x6xf32>", f"""
    {_sb("%sa", "%a", *bands[0])}
    {_sb("%sb", "%b", *bands[1])}
    {_sb("%sc", "%c", *bands[2])}
    %t = nova.add %sa, %sb : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
    %u = nova.add %t, %sc : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
    func.return %u, {"%sa" if reuse else "%u"} : tensor<4x6xf32>, tensor<4x6xf32>""")
  assert run(CANON, text) == printed(ir.parse_module(text))


def test_cat_of_copies_reads_the_copies_sources():
  """cat(view(copy(p)), view(copy(q))) merging the dims from the cat's on: a view of the sources' cat along a new
  dim, the copies gone (the gradients of q, k and v permuted back from attention's layout)."""
  args = "%p: tensor<2x4x3x5xf32>, %q: tensor<2x4x3x5xf32>"
  check(CANON, func(args, "tensor<2x3x40xf32>", """
    %a = nova.permute %p {dims = array<i64: 0, 2, 1, 3>} : (tensor<2x4x3x5xf32>) -> tensor<2x3x4x5xf32>
    %b = nova.permute %q {dims = array<i64: 0, 2, 1, 3>} : (tensor<2x4x3x5xf32>) -> tensor<2x3x4x5xf32>
    %ca = nova.copy %a : (tensor<2x3x4x5xf32>) -> tensor<2x3x4x5xf32>
    %cb = nova.copy %b : (tensor<2x3x4x5xf32>) -> tensor<2x3x4x5xf32>
    %va = nova.view %ca {shape = array<i64: 2, 3, 20>} : (tensor<2x3x4x5xf32>) -> tensor<2x3x20xf32>
    %vb = nova.view %cb {shape = array<i64: 2, 3, 20>} : (tensor<2x3x4x5xf32>) -> tensor<2x3x20xf32>
    %o = nova.cat %va, %vb {dim = 2 : i64} : (tensor<2x3x20xf32>, tensor<2x3x20xf32>) -> tensor<2x3x40xf32>
    func.return %o : tensor<2x3x40xf32>"""), func(args, "tensor<2x3x40xf32>", """
    %a = nova.permute %p {dims = array<i64: 0, 2, 1, 3>} : (tensor<2x4x3x5xf32>) -> tensor<2x3x4x5xf32>
    %b = nova.permute %q {dims = array<i64: 0, 2, 1, 3>} : (tensor<2x4x3x5xf32>) -> tensor<2x3x4x5xf32>
    %ua = nova.view %a {shape = array<i64: 2, 3, 1, 4, 5>} : (tensor<2x3x4x5xf32>) -> tensor<2x3x1x4x5xf32>
    %ub = nova.view %b {shape = array<i64: 2, 3, 1, 4, 5>} : (tensor<2x3x4x5xf32>) -> tensor<2x3x1x4x5xf32>
    %s = nova.cat %ua, %ub {dim = 2 : i64} : (tensor<2x3x1x4x5xf32>, tensor<2x3x1x4x5xf32>) -> tensor<2x3x2x4x5xf32>
    %o = nova.view %s {shape = array<i64: 2, 3, 40>} : (tensor<2x3x2x4x5xf32>) -> tensor<2x3x40xf32>
    func.return %o : tensor<2x3x40xf32>"""))


def test_split_gradient_compiles_to_eager_values():
  """A function of q, k, v split from one projection and permuted as attention's heads: compiled gradients equal
  eager ones exactly (the cat moves values, it computes none)."""
  import blutrain as bt
  x, w = bt.randn(2, 6, 8), bt.randn(8, 24, requires_grad=True)

  def f(x):
    q, k, v = (t.view(2, 6, 2, 4).transpose(1, 2) for t in (x @ w).split(8, dim=2))
    loss = ((q * k).exp() * v).sum()
    loss.backward()
    g = w.grad
    w.grad = None
    return loss.detach(), g
  want = f(x)
  step = bt.compile(f)
  for _ in range(3): got = step(x)
  for a, b in zip(got, want): np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_expand_of_expand():
  x = "%x: tensor<1x4xf32>"
  check(CANON, func(x, "tensor<2x3x4xf32>, tensor<1x4xf32>", """
    %a = nova.expand %x {shape = array<i64: 3, 4>} : (tensor<1x4xf32>) -> tensor<3x4xf32>
    %b = nova.expand %a {shape = array<i64: 2, 3, 4>} : (tensor<3x4xf32>) -> tensor<2x3x4xf32>
    %c = nova.expand %x {shape = array<i64: 1, 4>} : (tensor<1x4xf32>) -> tensor<1x4xf32>
    func.return %b, %c : tensor<2x3x4xf32>, tensor<1x4xf32>"""), func(x, "tensor<2x3x4xf32>, tensor<1x4xf32>", """
    %b = nova.expand %x {shape = array<i64: 2, 3, 4>} : (tensor<1x4xf32>) -> tensor<2x3x4xf32>
    func.return %b, %x : tensor<2x3x4xf32>, tensor<1x4xf32>"""))


@pytest.mark.parametrize("a, b, c, expected", [
  ("f32", "f32", None, "x"), ("f32", "f64", "f32", "x"), ("i32", "i64", "i32", "x"), ("i1", "f32", "i1", "x"),
  ("f16", "f32", "bf16", "cast"), ("bf16", "f64", "i64", "cast"),
  ("f32", "f16", "f32", "keep"), ("i64", "f64", "i64", "keep"), ("f32", "i32", "f32", "keep"), ("f16", "bf16", "f16", "keep"),
])
def test_cast_chains(a, b, c, expected):
  ty = lambda e: f"tensor<4x{e}>"
  args = f"%x: {ty(a)}"
  body = f"%b = nova.cast %x {{dtype = {b}}} : ({ty(a)}) -> {ty(b)}"
  last, out = "%b", b
  if c is not None:
    body += f"\n%c = nova.cast %b {{dtype = {c}}} : ({ty(b)}) -> {ty(c)}"
    last, out = "%c", c
  before = func(args, ty(out), body + f"\nfunc.return {last} : {ty(out)}")
  after = {"x": func(args, ty(out), f"func.return %x : {ty(out)}"),
           "cast": func(args, ty(out), f"%c = nova.cast %x {{dtype = {c}}} : ({ty(a)}) -> {ty(c)}\nfunc.return %c : {ty(c)}"),
           "keep": before}[expected]
  check(CANON, before, after)


# *** fold ***

FOLD = (FoldPass(), DCEPass())


def test_fold_elementwise_of_splats():
  check(FOLD, func("", "tensor<4xf32>, tensor<2xi1>", f"""
    {full("%a", "2.0 : f64", F32)}
    {full("%b", "3.0 : f64", F32, "4")}
    %c = nova.mul %a, %b : (tensor<f32>, tensor<4xf32>) -> tensor<4xf32>
    {full("%d", "1.5 : f64", F32, "4")}
    %e = nova.add %c, %d : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
    {full("%i", "1 : i64", I64, "2")}
    {full("%j", "2 : i64", I64)}
    %k = nova.lt %i, %j : (tensor<2xi64>, tensor<i64>) -> tensor<2xi1>
    func.return %e, %k : tensor<4xf32>, tensor<2xi1>"""), func("", "tensor<4xf32>, tensor<2xi1>", f"""
    {full("%e", "7.5 : f64", F32, "4")}
    {full("%k", "true", "i1", "2")}
    func.return %e, %k : tensor<4xf32>, tensor<2xi1>"""))


def test_fold_views_and_casts_of_splats():
  check(FOLD, func("", "tensor<2x3xi32>, tensor<3x2xf32>", f"""
    {full("%a", "2.75 : f64", F32, "1, 3")}
    %b = nova.expand %a {{shape = array<i64: 2, 3>}} : (tensor<1x3xf32>) -> tensor<2x3xf32>
    %c = nova.cast %b {{dtype = i32}} : (tensor<2x3xf32>) -> tensor<2x3xi32>
    %d = nova.permute %b {{dims = array<i64: 1, 0>}} : (tensor<2x3xf32>) -> tensor<3x2xf32>
    func.return %c, %d : tensor<2x3xi32>, tensor<3x2xf32>"""), func("", "tensor<2x3xi32>, tensor<3x2xf32>", f"""
    {full("%c", "2 : i64", I32, "2, 3")}
    {full("%d", "2.75 : f64", F32, "3, 2")}
    func.return %c, %d : tensor<2x3xi32>, tensor<3x2xf32>"""))


def _folded_value(body: str, result: str):
  module = ir.parse_module(func("", result, body))
  FoldPass().run(module)
  DCEPass().run(module)
  op, _ = ir.function(module).body.block.ops
  assert isinstance(op, FullOp)
  return op.attrs()["value"]


def test_fold_computes_in_the_dtype():
  """exp(1) in float32 is the float32 kernel's value; 1/0 is inf; neg(0.0) is -0.0; f16 rounds."""
  exp = _folded_value(f"""{full("%a", "1.0 : f64", F32)}
    %b = nova.exp %a : (tensor<f32>) -> tensor<f32>
    func.return %b : tensor<f32>""", "tensor<f32>")
  assert exp == float(np.exp(np.float32(1.0))) and exp != math.e
  inf = _folded_value(f"""{full("%a", "1.0 : f64", F32)}
    {full("%z", "0.0 : f64", F32)}
    %b = nova.div %a, %z : (tensor<f32>, tensor<f32>) -> tensor<f32>
    func.return %b : tensor<f32>""", "tensor<f32>")
  assert inf == math.inf
  neg = _folded_value(f"""{full("%a", "0.0 : f64", F32)}
    %b = nova.neg %a : (tensor<f32>) -> tensor<f32>
    func.return %b : tensor<f32>""", "tensor<f32>")
  assert literal(neg) == literal(-0.0)
  half = _folded_value(f"""{full("%a", "0.1 : f64", "f16")}
    %b = nova.add %a, %a : (tensor<f16>, tensor<f16>) -> tensor<f16>
    func.return %b : tensor<f16>""", "tensor<f16>")
  assert half == float(np.float16(0.1) + np.float16(0.1))


def test_fold_leaves_non_splats_and_reductions():
  before = func(X4, "tensor<4xf32>, tensor<f32>", f"""
    {full("%a", "2.0 : f64", F32)}
    %b = nova.mul %x, %a : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>
    {full("%c", "0.1 : f64", F32, "4")}
    %d = nova.sum %c {{dims = array<i64: 0>, keepdim = false, dtype = f32}} : (tensor<4xf32>) -> tensor<f32>
    func.return %b, %d : tensor<4xf32>, tensor<f32>""")
  check(FOLD, before, before)


# *** cse and dce ***

def test_cse_merges_equal_ops_only():
  check((CSEPass(),), func(X4, "tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>", f"""
    {full("%p", "0.0 : f64", F32)}
    {full("%q", "0.0 : f64", F32)}
    {full("%n", "-0.0 : f64", F32)}
    %a = nova.add %x, %p : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>
    %b = nova.add %x, %q : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>
    %c = nova.add %x, %n : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>
    %d = nova.add %p, %x : (tensor<f32>, tensor<4xf32>) -> tensor<4xf32>
    func.return %a, %b, %c, %d : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>"""),
    func(X4, "tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>", f"""
    {full("%p", "0.0 : f64", F32)}
    {full("%n", "-0.0 : f64", F32)}
    %a = nova.add %x, %p : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>
    %c = nova.add %x, %n : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>
    %d = nova.add %p, %x : (tensor<f32>, tensor<4xf32>) -> tensor<4xf32>
    func.return %a, %a, %c, %d : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>"""))


def test_cse_ignores_property_order_and_merges_equal_draws():
  rng = "%r: tensor<2xi64>"
  check((CSEPass(),), func(rng, "tensor<3xf32>, tensor<3xf32>, tensor<3xf32>", """
    %a = nova.rand %r {shape = array<i64: 3>, dtype = f32, offset = 0 : i64} : (tensor<2xi64>) -> tensor<3xf32>
    %b = nova.rand %r {offset = 0 : i64, dtype = f32, shape = array<i64: 3>} : (tensor<2xi64>) -> tensor<3xf32>
    %c = nova.rand %r {shape = array<i64: 3>, dtype = f32, offset = 3 : i64} : (tensor<2xi64>) -> tensor<3xf32>
    func.return %a, %b, %c : tensor<3xf32>, tensor<3xf32>, tensor<3xf32>"""), func(rng, "tensor<3xf32>, tensor<3xf32>, tensor<3xf32>", """
    %a = nova.rand %r {shape = array<i64: 3>, dtype = f32, offset = 0 : i64} : (tensor<2xi64>) -> tensor<3xf32>
    %c = nova.rand %r {shape = array<i64: 3>, dtype = f32, offset = 3 : i64} : (tensor<2xi64>) -> tensor<3xf32>
    func.return %a, %a, %c : tensor<3xf32>, tensor<3xf32>, tensor<3xf32>"""))


def test_dce_drops_dead_chains_keeps_outputs():
  check((DCEPass(),), func(X4, "tensor<4xf32>", """
    %a = nova.exp %x : (tensor<4xf32>) -> tensor<4xf32>
    %b = nova.neg %a : (tensor<4xf32>) -> tensor<4xf32>
    %c = nova.sin %b : (tensor<4xf32>) -> tensor<4xf32>
    %d = nova.cos %x : (tensor<4xf32>) -> tensor<4xf32>
    func.return %d : tensor<4xf32>"""), func(X4, "tensor<4xf32>", """
    %d = nova.cos %x : (tensor<4xf32>) -> tensor<4xf32>
    func.return %d : tensor<4xf32>"""))


# *** ops with several results ***

XWS = "%x: tensor<3x4xf32>, %w: tensor<4xf32>, %s: tensor<f32>"
SCALE = "nova.scale %x, %w, %s : (tensor<3x4xf32>, tensor<4xf32>, tensor<f32>) -> (tensor<3x4xf32>, tensor<4xf32>)"


def test_cse_merges_ops_with_several_results_result_by_result():
  check((CSEPass(), DCEPass()), func(XWS, "tensor<3x4xf32>, tensor<4xf32>, tensor<4xf32>", f"""
    %a, %b = {SCALE}
    %c, %d = {SCALE}
    func.return %a, %b, %d : tensor<3x4xf32>, tensor<4xf32>, tensor<4xf32>"""),
    func(XWS, "tensor<3x4xf32>, tensor<4xf32>, tensor<4xf32>", f"""
    %a, %b = {SCALE}
    func.return %a, %b, %b : tensor<3x4xf32>, tensor<4xf32>, tensor<4xf32>"""))


def test_dce_keeps_an_op_while_any_result_is_used():
  check((DCEPass(),), func(XWS, "tensor<4xf32>", f"""
    %a, %b = {SCALE}
    %c, %d = nova.scale %x, %x, %s : (tensor<3x4xf32>, tensor<3x4xf32>, tensor<f32>) -> (tensor<3x4xf32>, tensor<3x4xf32>)
    func.return %b : tensor<4xf32>"""), func(XWS, "tensor<4xf32>", f"""
    %a, %b = {SCALE}
    func.return %b : tensor<4xf32>"""))


def test_patterns_see_through_and_leave_alone_ops_with_several_results():
  """x * 1 drops for a result of a multi-result op; a multi-result op of splats is not folded (it is no elementwise
  op, whatever it computes)."""
  check(CANON, func(XWS, "tensor<3x4xf32>, tensor<4xf32>", f"""
    %a, %b = {SCALE}
    {full("%one", "1.0 : f64", F32)}
    %c = nova.mul %b, %one : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>
    func.return %a, %c : tensor<3x4xf32>, tensor<4xf32>"""), func(XWS, "tensor<3x4xf32>, tensor<4xf32>", f"""
    %a, %b = {SCALE}
    func.return %a, %b : tensor<3x4xf32>, tensor<4xf32>"""))
  splats = func("", "tensor<4xf32>", f"""
    {full("%f", "2.0 : f64", F32, "4")}
    {full("%h", "0.5 : f64", F32)}
    %a = nova.scale %f, %h : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>
    func.return %a : tensor<4xf32>""")
  check(FOLD, splats, splats)


# *** the pipeline ***

def test_optimize_folds_into_identities_and_dumps(tmp_path):
  before = func(X4, "tensor<4xf32>", f"""
    {full("%a", "2.0 : f64", F32)}
    {full("%b", "0.5 : f64", F32)}
    %c = nova.mul %a, %b : (tensor<f32>, tensor<f32>) -> tensor<f32>
    %d = nova.mul %x, %c : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>
    %e = nova.exp %d : (tensor<4xf32>) -> tensor<4xf32>
    %f = nova.exp %d : (tensor<4xf32>) -> tensor<4xf32>
    %g = nova.add %e, %f : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
    func.return %g : tensor<4xf32>""")
  module = ir.parse_module(before)
  assert op_counts(module) == {"add": 1, "exp": 2, "full": 2, "mul": 2}
  optimize(module, dump_dir=tmp_path, verify=True)
  assert printed(module) == printed(ir.parse_module(func(X4, "tensor<4xf32>", """
    %e = nova.exp %x : (tensor<4xf32>) -> tensor<4xf32>
    %g = nova.add %e, %e : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
    func.return %g : tensor<4xf32>""")))
  assert op_counts(module) == {"add": 1, "exp": 1}
  names = sorted(p.name for p in tmp_path.iterdir())
  assert names == ["00-captured.mlir", "01-canonicalize.mlir", "02-fold.mlir", "03-canonicalize.mlir", "04-fold.mlir",
                   "05-fuse-casts.mlir", "06-fuse-gemm.mlir", "07-cse.mlir", "08-dce.mlir"]
  assert printed(ir.parse_module((tmp_path / "08-dce.mlir").read_text())) == printed(module)
  text = ir.print_module(module)
  optimize(module)
  assert ir.print_module(module) == text, "a second run finds nothing left to do"


def test_passes_are_named_module_passes():
  assert set(PASSES) == {"canonicalize", "fold", "fuse-casts", "fuse-gemm", "cse", "dce", "fuse-norms",
                         "fuse-bias-grads", "fuse-wgrad", "fuse-pointwise"}
  module = ir.parse_module(func(X4, "tensor<4xf32>", """
    %a = nova.neg %x : (tensor<4xf32>) -> tensor<4xf32>
    %b = nova.neg %a : (tensor<4xf32>) -> tensor<4xf32>
    func.return %b : tensor<4xf32>"""))
  PASSES["canonicalize"]().apply(ir.context(), module)
  assert op_counts(module) == {"neg": 1}
  PASSES["dce"]().apply(ir.context(), module)
  assert op_counts(module) == {}
