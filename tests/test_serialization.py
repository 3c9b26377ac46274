"""bt.save / bt.load: exact round trips of nested state (every dtype, non-contiguous views, 0-d and empty tensors),
the sharing policy, map_location, atomic writes, and the errors for missing, corrupt and foreign files."""
import io
import os
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import torch

import blutrain as bt
from blutrain import nn
from tests.helpers import to_numpy

DTYPES = [bt.bool, bt.int32, bt.int64, bt.float16, bt.bfloat16, bt.float32, bt.float64]


def equal(a: bt.Tensor, b: bt.Tensor) -> None:
  assert a.shape == b.shape and a.dtype is b.dtype and a.device == b.device and a.requires_grad == b.requires_grad
  np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


def sample_state():
  base = bt.randn(4, 6, generator=bt.Generator().manual_seed(0))
  return {
    "tensors": {d.name: (bt.randn(3, 2) * 50).to(d) for d in DTYPES},
    "view": base.T[1:, ::2],  # non-contiguous, with an offset
    "scalar": bt.tensor(2.5, dtype=bt.float64), "empty": bt.zeros(0, 3, dtype=bt.int64),
    "param": nn.Parameter(bt.randn(2)),
    "numbers": [1, 2.5, float("inf"), True, None, "text", (3, "x")], "nested": {1: {"k": [bt.arange(3)]}},
    "odict": OrderedDict(b=1, a=2), "dtype": bt.bfloat16, "device": bt.device("cpu"), "np": np.float32(1.5),
  }


def test_round_trip_is_exact_for_every_dtype_and_layout(tmp_path):
  state = sample_state()
  bt.save(state, tmp_path / "s.bt")
  got = bt.load(tmp_path / "s.bt")
  for d in DTYPES: equal(got["tensors"][d.name], state["tensors"][d.name])
  for k in ("view", "scalar", "empty", "param"): equal(got[k], state[k])
  assert got["view"].is_contiguous() and got["param"].requires_grad and not isinstance(got["param"], nn.Parameter)
  assert got["numbers"] == [1, 2.5, float("inf"), True, None, "text", (3, "x")]
  assert type(got["numbers"][3]) is bool and type(got["numbers"][6]) is tuple
  assert list(got["nested"]) == [1] and got["nested"][1]["k"][0].tolist() == [0, 1, 2]
  assert type(got["odict"]) is OrderedDict and list(got["odict"]) == ["b", "a"]
  assert got["dtype"] is bt.bfloat16 and got["device"] == bt.device("cpu") and got["np"] == 1.5


def test_sharing_policy_same_object_once_views_independent(tmp_path):
  base = bt.arange(6, dtype=bt.float32)
  view = base[2:]
  buf = io.BytesIO()
  bt.save({"a": base, "b": base, "v": view}, buf)
  buf.seek(0)
  got = bt.load(buf)
  assert got["a"] is got["b"]
  with bt.no_grad(): got["a"].fill_(0.0)
  assert got["v"].tolist() == [2.0, 3.0, 4.0, 5.0]  # written as its own copy


def test_state_dicts_of_a_model_and_optimizer_load_back(tmp_path):
  model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
  opt = bt.optim.AdamW(model.parameters(), lr=0.1)
  model(bt.randn(2, 3)).sum().backward()
  opt.step()
  bt.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.bt")
  got = bt.load(tmp_path / "ckpt.bt", weights_only=True)
  model2 = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
  model2.load_state_dict(got["model"])
  for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()): equal(a, b)
  opt2 = bt.optim.AdamW(model2.parameters(), lr=0.5)
  opt2.load_state_dict(got["opt"])
  assert opt2.param_groups[0]["lr"] == 0.1 and set(opt2.state_dict()["state"]) == set(opt.state_dict()["state"])
  equal(opt2.state[model2[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])


def test_map_location_forms_and_cuda_without_a_gpu(tmp_path):
  path = tmp_path / "m.bt"
  bt.save({"w": bt.ones(2)}, path)
  for loc in (None, "cpu", bt.device("cpu"), {"cuda:0": "cpu"}):
    assert bt.load(path, map_location=loc)["w"].device == bt.device("cpu")
  if not bt.cuda.is_available():
    with pytest.raises(RuntimeError, match="map_location='cpu'"): bt.load(path, map_location="cuda")
    with pytest.raises(RuntimeError, match="map_location='cpu'"): bt.load(path, map_location={"cpu": "cuda:0"})
  with pytest.raises(TypeError, match="map_location"): bt.load(path, map_location=3)
  seen = []
  got = bt.load(path, map_location=lambda t, loc: seen.append(loc) or t * 2)  # PyTorch's (storage, location) form
  assert seen == ["cpu"] and got["w"].tolist() == [2.0, 2.0]


def test_save_is_atomic_and_leaves_no_temporary_file(tmp_path):
  path = tmp_path / "a.bt"
  bt.save({"x": bt.ones(3)}, path)
  with pytest.raises(TypeError, match=r"cannot save object at \['bad'\]"): bt.save({"x": bt.zeros(3), "bad": object()}, path)
  assert os.listdir(tmp_path) == ["a.bt"] and bt.load(path)["x"].tolist() == [1.0, 1.0, 1.0]
  with pytest.raises(TypeError, match="cannot save set"): bt.save({1, 2}, io.BytesIO())


def test_missing_corrupt_and_foreign_files_raise_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError): bt.load(tmp_path / "nope.bt")
  (tmp_path / "text.bt").write_text("hello")
  with pytest.raises(RuntimeError, match="not a bt.save file"): bt.load(tmp_path / "text.bt")
  path = tmp_path / "c.bt"
  w = bt.randn(64)
  bt.save({"w": w}, path)
  data = bytearray(path.read_bytes())
  data[data.find(w.numpy().tobytes()) + 100] ^= 0x10  # a flipped bit inside the stored tensor bytes
  (tmp_path / "flip.bt").write_bytes(bytes(data))
  with pytest.raises(RuntimeError, match="corrupt|CRC"): bt.load(tmp_path / "flip.bt")
  (tmp_path / "cut.bt").write_bytes(path.read_bytes()[:-40])
  with pytest.raises(RuntimeError, match="not a bt.save file or is corrupt"): bt.load(tmp_path / "cut.bt")
  torch.save({"w": torch.ones(2)}, tmp_path / "torch.pt")
  with pytest.raises(RuntimeError, match="torch.save"): bt.load(tmp_path / "torch.pt")
  with zipfile.ZipFile(tmp_path / "other.zip", "w") as z: z.writestr("readme.txt", "hi")
  with pytest.raises(RuntimeError, match="no structure.json"): bt.load(tmp_path / "other.zip")
