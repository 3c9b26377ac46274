"""Module and Parameter: the containers of model state, with PyTorch's registration, traversal and state_dict."""
from __future__ import annotations

import itertools
from collections import OrderedDict, namedtuple
from typing import Any, Callable, Iterator

from blutrain import dtypes, ops, shapes
from blutrain.device import Device, to_device
from blutrain.autograd import no_grad
from blutrain.tensor import Tensor


class Parameter(Tensor):
  """A tensor that a Module registers as a trainable parameter when assigned as an attribute.

  `Parameter(t)` shares t's storage (no copy) and requires grad unless `requires_grad=False`.
  """
  __slots__ = ()

  def __new__(cls, data: Tensor | None = None, requires_grad: bool = True) -> Parameter:
    if data is None: data = ops.empty(0)
    if not isinstance(data, Tensor):
      raise TypeError(f"Parameter: expected a Tensor, got {type(data).__name__}; wrap data with bt.tensor(...) first")
    p = cls._make(data._storage, data.shape, data._strides, data._offset, data.dtype)
    if requires_grad: p.requires_grad_(True)
    return p

  def __repr__(self) -> str: return "Parameter containing:\n" + super().__repr__()


_IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


_hook_ids = itertools.count()


class _Registry(OrderedDict):
  """A module's parameters, buffers or children by name. Every change counts in `Module.registry_version`, which
  tells a compiled step when a module tree may have changed (it walks the trees again only then)."""

  def _changed(self) -> None: Module.registry_version += 1

  def __setitem__(self, key, value) -> None:
    self._changed()
    super().__setitem__(key, value)

  def __delitem__(self, key) -> None:
    self._changed()
    super().__delitem__(key)

  def __ior__(self, other):
    self.update(other)
    return self

  def update(self, *args, **kwargs) -> None:
    self._changed()
    super().update(*args, **kwargs)

  def pop(self, *args):
    self._changed()
    return super().pop(*args)

  def popitem(self, last: bool = True):
    self._changed()
    return super().popitem(last)

  def setdefault(self, key, default=None):
    self._changed()
    return super().setdefault(key, default)

  def clear(self) -> None:
    self._changed()
    super().clear()

  def move_to_end(self, key, last: bool = True) -> None:
    self._changed()
    super().move_to_end(key, last)


class _RemovableHandle:
  def __init__(self, hooks: dict, key: int): self.hooks, self.key = hooks, key
  def remove(self) -> None: self.hooks.pop(self.key, None)


class Module:
  """Base class of all layers and models, as `torch.nn.Module`.

  Assigning a Parameter or a Module as an attribute registers it; `register_buffer` adds non-trainable state.
  Subclasses call `super().__init__()` first and define `forward`; calling the module runs `forward`.

  Example:
    >>> class MLP(nn.Module):
    ...   def __init__(self):
    ...     super().__init__()
    ...     self.fc = nn.Linear(4, 8)
    ...   def forward(self, x): return F.gelu(self.fc(x))
  """
  training: bool
  registry_version: int = 0  # counts the changes of every module's registries (`_Registry`)

  def __init__(self) -> None:
    d = self.__dict__
    d["training"] = True
    d["_parameters"], d["_buffers"], d["_modules"] = _Registry(), _Registry(), _Registry()
    d["_non_persistent_buffers_set"] = set()
    d["_forward_pre_hooks"], d["_forward_hooks"] = OrderedDict(), OrderedDict()

  def forward(self, *args, **kwargs) -> Any:
    raise NotImplementedError(f'Module [{type(self).__name__}] is missing the required "forward" function')

  def __call__(self, *args, **kwargs) -> Any:
    if not (self._forward_pre_hooks or self._forward_hooks): return self.forward(*args, **kwargs)
    for hook in list(self._forward_pre_hooks.values()):
      out = hook(self, args)
      if out is not None: args = out if isinstance(out, tuple) else (out,)
    result = self.forward(*args, **kwargs)
    for hook in list(self._forward_hooks.values()):
      out = hook(self, args, result)
      if out is not None: result = out
    return result

  def register_forward_pre_hook(self, hook: Callable) -> _RemovableHandle:
    """Call `hook(module, args)` before forward; a returned value replaces the positional args."""
    key = next(_hook_ids)
    self._forward_pre_hooks[key] = hook
    return _RemovableHandle(self._forward_pre_hooks, key)

  def register_forward_hook(self, hook: Callable) -> _RemovableHandle:
    """Call `hook(module, args, output)` after forward; a returned value replaces the output."""
    key = next(_hook_ids)
    self._forward_hooks[key] = hook
    return _RemovableHandle(self._forward_hooks, key)

  # *** registration ***

  def _check_name(self, kind: str, name: str) -> None:
    if "_parameters" not in self.__dict__:
      raise AttributeError(f"cannot assign {kind} before Module.__init__() call")
    if not isinstance(name, str): raise TypeError(f"{kind} name should be a string, got {type(name).__name__}")
    if "." in name or name == "": raise KeyError(f'{kind} name can\'t contain "." or be empty, got {name!r}')

  def register_parameter(self, name: str, param: Parameter | None) -> None:
    """Add a parameter (or None, a declared but absent one, like a Linear without bias)."""
    self._check_name("parameter", name)
    if hasattr(self, name) and name not in self._parameters: raise KeyError(f"attribute '{name}' already exists")
    if param is not None and not isinstance(param, Parameter):
      raise TypeError(f"cannot assign '{type(param).__name__}' object to parameter '{name}' "
                      "(nn.Parameter or None required)")
    self._parameters[name] = param

  def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
    """Add state that is not trained (a mask, running statistics); `persistent=False` keeps it out of state_dict."""
    self._check_name("buffer", name)
    if hasattr(self, name) and name not in self._buffers: raise KeyError(f"attribute '{name}' already exists")
    if tensor is not None and not isinstance(tensor, Tensor):
      raise TypeError(f"cannot assign '{type(tensor).__name__}' object to buffer '{name}' (Tensor or None required)")
    self._buffers[name] = tensor
    if persistent: self._non_persistent_buffers_set.discard(name)
    else: self._non_persistent_buffers_set.add(name)

  def add_module(self, name: str, module: Module | None) -> None:
    """Add a child module, reachable as an attribute and under `name.` in state_dict."""
    self._check_name("module", name)
    if hasattr(self, name) and name not in self._modules: raise KeyError(f"attribute '{name}' already exists")
    if module is not None and not isinstance(module, Module):
      raise TypeError(f"{type(module).__name__} is not a Module subclass")
    self._modules[name] = module

  register_module = add_module

  def __setattr__(self, name: str, value: Any) -> None:
    d = self.__dict__
    params, buffers, modules = d.get("_parameters"), d.get("_buffers"), d.get("_modules")
    if isinstance(value, Parameter):
      if params is None: raise AttributeError("cannot assign parameters before Module.__init__() call")
      self._forget(name, keep="_parameters")
      params[name] = value
    elif params is not None and name in params:
      if value is not None:
        raise TypeError(f"cannot assign '{type(value).__name__}' as parameter '{name}' (nn.Parameter or None expected)")
      params[name] = None
    elif isinstance(value, Module):
      if modules is None: raise AttributeError("cannot assign module before Module.__init__() call")
      self._forget(name, keep="_modules")
      modules[name] = value
    elif modules is not None and name in modules:
      if value is not None:
        raise TypeError(f"cannot assign '{type(value).__name__}' as child module '{name}' (nn.Module or None expected)")
      modules[name] = None
    elif buffers is not None and name in buffers:
      if value is not None and not isinstance(value, Tensor):
        raise TypeError(f"cannot assign '{type(value).__name__}' as buffer '{name}' (Tensor or None expected)")
      buffers[name] = value
    else:
      object.__setattr__(self, name, value)

  def _forget(self, name: str, keep: str) -> None:
    """Drop `name` from the instance dict and the registries other than `keep` (where it keeps its position)."""
    self.__dict__.pop(name, None)
    for reg in ("_parameters", "_buffers", "_modules"):
      if reg != keep: self.__dict__[reg].pop(name, None)
    self._non_persistent_buffers_set.discard(name)

  def __getattr__(self, name: str) -> Any:
    d = self.__dict__  # reached only when normal lookup fails
    for reg in ("_parameters", "_buffers", "_modules"):
      if reg in d and name in d[reg]: return d[reg][name]
    raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

  def __delattr__(self, name: str) -> None:
    for reg in ("_parameters", "_buffers", "_modules"):
      if name in self.__dict__.get(reg, ()):
        del self.__dict__[reg][name]
        self._non_persistent_buffers_set.discard(name)
        return
    object.__delattr__(self, name)

  def __dir__(self) -> list[str]:
    return sorted(set(super().__dir__()) | set(self._parameters) | set(self._buffers) | set(self._modules))

  # *** traversal ***

  def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True
                    ) -> Iterator[tuple[str, Module]]:
    """(name, module) for this module and every descendant, depth first; a shared module once."""
    if memo is None: memo = set()
    if remove_duplicate:
      if id(self) in memo: return
      memo.add(id(self))
    yield prefix, self
    for name, child in self._modules.items():
      if child is None: continue
      yield from child.named_modules(memo, prefix + ("." if prefix else "") + name, remove_duplicate)

  def modules(self) -> Iterator[Module]:
    for _, m in self.named_modules(): yield m

  def named_children(self) -> Iterator[tuple[str, Module]]:
    seen = set()
    for name, child in self._modules.items():
      if child is not None and id(child) not in seen:
        seen.add(id(child))
        yield name, child

  def children(self) -> Iterator[Module]:
    for _, m in self.named_children(): yield m

  def _named_members(self, registry: str, prefix: str, recurse: bool, remove_duplicate: bool):
    seen = set()
    mods = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse else [(prefix, self)]
    for mod_prefix, mod in mods:
      for name, t in mod.__dict__[registry].items():
        if t is None or (remove_duplicate and id(t) in seen): continue
        seen.add(id(t))
        yield mod_prefix + ("." if mod_prefix else "") + name, t

  def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                       ) -> Iterator[tuple[str, Parameter]]:
    """(name, parameter) pairs, names dotted like "transformer.h.0.attn.c_attn.weight"; a tied parameter once."""
    if prefix or not recurse or not remove_duplicate:
      return self._named_members("_parameters", prefix, recurse, remove_duplicate)
    # NOTE: a training step asks every step (clip_grad_norm_(model.parameters())): the walk is kept until a registry
    # of any module changes
    cached = self.__dict__.get("_named_parameters")
    if cached is None or cached[0] != Module.registry_version:
      cached = self.__dict__["_named_parameters"] = (Module.registry_version,
                                                     list(self._named_members("_parameters", "", True, True)))
    return iter(cached[1])

  def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
    for _, p in self.named_parameters(recurse=recurse): yield p

  def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                    ) -> Iterator[tuple[str, Tensor]]:
    return self._named_members("_buffers", prefix, recurse, remove_duplicate)

  def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
    for _, b in self.named_buffers(recurse=recurse): yield b

  def get_submodule(self, target: str) -> Module:
    """The descendant at the dotted path `target` ("" is self)."""
    mod = self
    for item in target.split(".") if target else ():
      if not isinstance(mod._modules.get(item), Module):
        raise AttributeError(f"{type(mod).__name__} has no submodule `{item}` (looking up '{target}')")
      mod = mod._modules[item]
    return mod

  def get_parameter(self, target: str) -> Parameter:
    mod_path, _, name = target.rpartition(".")
    mod = self.get_submodule(mod_path)
    if not isinstance(mod._parameters.get(name), Parameter):
      raise AttributeError(f"{type(mod).__name__} has no parameter `{name}` (looking up '{target}')")
    return mod._parameters[name]

  def num_parameters(self, only_trainable: bool = False) -> int:
    """How many scalars the parameters hold, a tied parameter counted once."""
    return sum(p.numel() for p in self.parameters() if p.requires_grad or not only_trainable)

  # *** state_dict ***

  def _state_items(self, prefix: str = "", keep_vars: bool = False) -> Iterator[tuple[str, Tensor]]:
    """Parameters then persistent buffers of each module, parents before children; tied tensors under every name."""
    for name, p in self._parameters.items():
      if p is not None: yield prefix + name, (p if keep_vars else p.detach())
    for name, b in self._buffers.items():
      if b is not None and name not in self._non_persistent_buffers_set:
        yield prefix + name, (b if keep_vars else b.detach())
    for name, child in self._modules.items():
      if child is not None: yield from child._state_items(prefix + name + ".", keep_vars)

  def state_dict(self, *, destination: dict | None = None, prefix: str = "", keep_vars: bool = False) -> OrderedDict:
    """An OrderedDict from dotted names to the parameters and persistent buffers, detached but sharing storage
    (writing into one writes into the model, as nanoGPT's `from_pretrained` relies on)."""
    out = OrderedDict() if destination is None else destination
    out.update(self._state_items(prefix, keep_vars))
    return out

  def load_state_dict(self, state_dict: dict, strict: bool = True) -> _IncompatibleKeys:
    """Copy `state_dict`'s values into the parameters and buffers in place (optimizers keep their references).

    Returns (missing_keys, unexpected_keys). Raises RuntimeError, before changing anything, on a size mismatch,
    and with `strict` also on missing or unexpected keys.
    """
    own = OrderedDict(self._state_items())
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    errors = []
    if strict and missing: errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ". ")
    if strict and unexpected:
      errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    for key, dst in own.items():
      if key not in state_dict: continue
      src = state_dict[key]
      if not hasattr(src, "shape"):
        errors.append(f'While copying the parameter named "{key}", expected a Tensor from the checkpoint but received '
                      f"{type(src).__name__}")
      elif tuple(src.shape) != dst.shape:
        errors.append(f"size mismatch for {key}: copying a param with shape {tuple(src.shape)} from checkpoint, "
                      f"the shape in current model is {dst.shape}.")
    if errors: raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t" + "\n\t".join(errors))
    with no_grad():
      for key, dst in own.items():
        if key in state_dict: dst.copy_(state_dict[key])
    return _IncompatibleKeys(missing, unexpected)

  # *** modes, conversion, gradients ***

  def train(self, mode: bool = True) -> Module:
    """Set training mode (dropout active) on this module and every descendant."""
    if not isinstance(mode, bool): raise ValueError("training mode is expected to be boolean")
    self.training = mode
    for child in self.children(): child.train(mode)
    return self

  def eval(self) -> Module: return self.train(False)

  def apply(self, fn: Callable[[Module], None]) -> Module:
    """Call fn on every descendant, children first, then on self (as nanoGPT's `self.apply(self._init_weights)`)."""
    for child in self.children(): child.apply(fn)
    fn(self)
    return self

  def _apply(self, fn: Callable[[Tensor], Tensor]) -> Module:
    """Convert every parameter (in place, keeping its identity), its gradient and every buffer with fn."""
    with no_grad():
      for m in self.modules():
        for p in m._parameters.values():
          if p is None: continue
          new = fn(p)
          if new is not p: p.data = new
          if p.grad is not None: p.grad = fn(p.grad)
        for name, b in m._buffers.items():
          if b is not None: m._buffers[name] = fn(b)
    return self

  def to(self, *args, **kwargs) -> Module:
    """`model.to(device)`, `model.to(dtype)` or both: parameters and buffers move in place; a dtype applies to
    the floating-point ones only. `memory_format=bt.channels_last` (or `channels_last_3d`) lays out the parameters
    and buffers of as many dims (a convolution's weights) that way, as PyTorch's does."""
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    fmt = kwargs.pop("memory_format", shapes.preserve_format)
    kwargs.pop("non_blocking", None)
    if kwargs: raise TypeError(f"to(): unexpected arguments {sorted(kwargs)}")
    for a in args:
      if isinstance(a, Tensor): device, dtype = a.device, a.dtype
      elif isinstance(a, Device) or (isinstance(a, str) and a.split(":")[0] in ("cpu", "cuda")): device = a
      else: dtype = a
    device = to_device(device) if device is not None else None
    dtype = dtypes.to_dtype(dtype) if dtype is not None else None
    if dtype is not None and not dtype.is_floating_point:
      raise TypeError(f"nn.Module.to only accepts floating point dtypes, but got desired dtype={dtype!r}")

    def convert(t: Tensor) -> Tensor:
      if dtype is not None and t.is_floating_point(): t = t.to(dtype)
      if device is not None: t = t.to(device)
      return t.contiguous(memory_format=fmt) if fmt.ndim and t.ndim == fmt.ndim else t
    return self._apply(convert)

  def cpu(self) -> Module: return self.to("cpu")
  def cuda(self, device: int | None = None) -> Module: return self.to(f"cuda:{device or 0}")
  def float(self) -> Module: return self.to(dtypes.float32)
  def double(self) -> Module: return self.to(dtypes.float64)
  def half(self) -> Module: return self.to(dtypes.float16)
  def bfloat16(self) -> Module: return self.to(dtypes.bfloat16)

  def zero_grad(self, set_to_none: bool = True) -> None:
    """Clear every parameter's `.grad` (to None, or to zeros when `set_to_none=False`)."""
    for p in self.parameters():
      if p.grad is None: continue
      if set_to_none: p.grad = None
      else: p.grad.zero_()

  def requires_grad_(self, requires_grad: bool = True) -> Module:
    for p in self.parameters(): p.requires_grad_(requires_grad)
    return self

  # *** printing ***

  def extra_repr(self) -> str:
    """The text inside this module's parentheses when printed; layers override it."""
    return ""

  def _get_name(self) -> str: return type(self).__name__

  def __repr__(self) -> str:
    lines = self.extra_repr().split("\n") if self.extra_repr() else []
    for name, child in self._modules.items():
      lines.append(f"({name}): " + _indent(repr(child)))
    if not lines: return self._get_name() + "()"
    if len(lines) == 1 and not self._modules: return f"{self._get_name()}({lines[0]})"
    return self._get_name() + "(\n  " + "\n  ".join(lines) + "\n)"


def _indent(text: str) -> str: return text.replace("\n", "\n  ")
