"""Convolution and pooling layers: Conv1d/2d/3d, ConvTranspose1d/2d/3d, MaxPool1d/2d, AvgPool1d/2d, AdaptiveAvgPool1d/2d.

Each owns its weights (PyTorch's initialization) and options; the math is `nn.functional`'s (composites in
`nn/spatial.py`)."""
from __future__ import annotations


from blutrain import ops
from blutrain.nn import functional as F, init
from blutrain.nn.module import Module, Parameter
from blutrain.tensor import Tensor


def _ntuple(v, n: int) -> tuple:
  return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


class _ConvNd(Module):
  """Shared state of convolutions: weight (out, in / groups, *kernel) or, transposed, (in, out / groups, *kernel)."""
  in_channels: int
  out_channels: int
  kernel_size: tuple[int, ...]
  weight: Parameter

  def __init__(self, nd: int, in_channels: int, out_channels: int, kernel_size, stride, padding, dilation,
               transposed: bool, output_padding, groups: int, bias: bool, padding_mode: str, device, dtype) -> None:
    super().__init__()
    if groups <= 0: raise ValueError("groups must be a positive integer")
    if in_channels % groups: raise ValueError("in_channels must be divisible by groups")
    if out_channels % groups: raise ValueError("out_channels must be divisible by groups")
    if isinstance(padding, str):
      if padding not in ("same", "valid"):
        raise ValueError(f"Invalid padding string {padding!r}, should be one of {{'valid', 'same'}}")
      if padding == "same" and any(s != 1 for s in _ntuple(stride, nd)):
        raise ValueError("padding='same' is not supported for strided convolutions")
    if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
      raise ValueError(f"padding_mode must be one of ['zeros', 'reflect', 'replicate', 'circular'], but got "
                       f"padding_mode='{padding_mode}'")
    if transposed and padding_mode != "zeros":
      raise ValueError(f'Only "zeros" padding mode is supported for {type(self).__name__}')
    self.in_channels, self.out_channels, self.groups, self.padding_mode = in_channels, out_channels, groups, padding_mode
    self.kernel_size, self.stride = _ntuple(kernel_size, nd), _ntuple(stride, nd)
    self.padding = padding if isinstance(padding, str) else _ntuple(padding, nd)
    self.dilation, self.output_padding, self.transposed = _ntuple(dilation, nd), _ntuple(output_padding, nd), transposed
    shape = (in_channels, out_channels // groups) if transposed else (out_channels, in_channels // groups)
    self.weight = Parameter(ops.empty(*shape, *self.kernel_size, device=device, dtype=dtype))
    if bias: self.bias = Parameter(ops.empty(out_channels, device=device, dtype=dtype))
    else: self.register_parameter("bias", None)
    self.reset_parameters()

  def reset_parameters(self) -> None: init.layer_default_(self.weight, self.bias)

  def _padded(self, input: Tensor) -> tuple[Tensor, object]:
    """The input padded by padding_mode (when not zeros) and the padding left for the convolution itself."""
    if self.padding_mode == "zeros" or isinstance(self.padding, str) and self.padding == "valid": return input, self.padding
    if isinstance(self.padding, str):  # 'same' with a non-zero mode: pad here, PyTorch's split of the total
      total = [d * (k - 1) for d, k in zip(self.dilation, self.kernel_size)]
      amounts = [a for t in reversed(total) for a in (t // 2, t - t // 2)]
    else:
      amounts = [p for p in reversed(self.padding) for _ in range(2)]
    return F.pad(input, tuple(amounts), mode=self.padding_mode), 0

  def extra_repr(self) -> str:
    s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
    if self.padding != (0,) * len(self.kernel_size): s += f", padding={self.padding}"
    if self.dilation != (1,) * len(self.kernel_size): s += f", dilation={self.dilation}"
    if self.output_padding != (0,) * len(self.kernel_size): s += f", output_padding={self.output_padding}"
    if self.groups != 1: s += f", groups={self.groups}"
    if self.bias is None: s += ", bias=False"
    if self.padding_mode != "zeros": s += f", padding_mode={self.padding_mode}"
    return s


class Conv1d(_ConvNd):
  """1-D convolution over (N, C_in, L) -> (N, C_out, L_out), as `torch.nn.Conv1d`.

  Args: in_channels, out_channels, kernel_size; stride (1), padding (0, or "valid"/"same"), dilation (1),
  groups (1), bias (True), padding_mode ("zeros", "reflect", "replicate", "circular").
  Attributes: weight (out_channels, in_channels / groups, kernel_size), bias (out_channels,), both from
  U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  """

  def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
               groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None) -> None:
    super().__init__(1, in_channels, out_channels, kernel_size, stride, padding, dilation, False, 0, groups, bias,
                     padding_mode, device, dtype)

  def forward(self, input: Tensor) -> Tensor:
    x, padding = self._padded(input)
    return F.conv1d(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)


class Conv2d(_ConvNd):
  """2-D convolution over (N, C_in, H, W) -> (N, C_out, H_out, W_out), as `torch.nn.Conv2d`.

  Args: in_channels, out_channels, kernel_size; stride (1), padding (0, or "valid"/"same"), dilation (1),
  groups (1), bias (True), padding_mode ("zeros", "reflect", "replicate", "circular").
  Attributes: weight (out_channels, in_channels / groups, kh, kw), bias (out_channels,), both from
  U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

  Example:
    >>> nn.Conv2d(3, 16, 3, padding=1)(bt.randn(8, 3, 32, 32)).shape
    (8, 16, 32, 32)
  """

  def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
               groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None) -> None:
    super().__init__(2, in_channels, out_channels, kernel_size, stride, padding, dilation, False, 0, groups, bias,
                     padding_mode, device, dtype)

  def forward(self, input: Tensor) -> Tensor:
    x, padding = self._padded(input)
    return F.conv2d(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)


class Conv3d(_ConvNd):
  """3-D convolution over (N, C_in, D, H, W) -> (N, C_out, D_out, H_out, W_out), as `torch.nn.Conv3d`.

  Args: in_channels, out_channels, kernel_size; stride (1), padding (0, or "valid"/"same"), dilation (1),
  groups (1), bias (True), padding_mode ("zeros", "reflect", "replicate", "circular").
  Attributes: weight (out_channels, in_channels / groups, kd, kh, kw), bias (out_channels,), both from
  U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  """

  def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
               groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None) -> None:
    super().__init__(3, in_channels, out_channels, kernel_size, stride, padding, dilation, False, 0, groups, bias,
                     padding_mode, device, dtype)

  def forward(self, input: Tensor) -> Tensor:
    x, padding = self._padded(input)
    return F.conv3d(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)


class ConvTranspose1d(_ConvNd):
  """1-D transposed convolution (the gradient of Conv1d): weight (in_channels, out_channels / groups, k)."""

  def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, output_padding=0,
               groups: int = 1, bias: bool = True, dilation=1, padding_mode: str = "zeros", device=None,
               dtype=None) -> None:
    super().__init__(1, in_channels, out_channels, kernel_size, stride, padding, dilation, True, output_padding,
                     groups, bias, padding_mode, device, dtype)

  def forward(self, input: Tensor) -> Tensor:
    return F.conv_transpose1d(input, self.weight, self.bias, self.stride, self.padding, self.output_padding,
                              self.groups, self.dilation)


class ConvTranspose2d(_ConvNd):
  """2-D transposed convolution (the gradient of Conv2d, an upsampling layer): weight (in_channels,
  out_channels / groups, kh, kw); output size (H - 1) * stride - 2 * padding + dilation * (k - 1) + output_padding + 1."""

  def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, output_padding=0,
               groups: int = 1, bias: bool = True, dilation=1, padding_mode: str = "zeros", device=None,
               dtype=None) -> None:
    super().__init__(2, in_channels, out_channels, kernel_size, stride, padding, dilation, True, output_padding,
                     groups, bias, padding_mode, device, dtype)

  def forward(self, input: Tensor) -> Tensor:
    return F.conv_transpose2d(input, self.weight, self.bias, self.stride, self.padding, self.output_padding,
                              self.groups, self.dilation)


class ConvTranspose3d(_ConvNd):
  """3-D transposed convolution (the gradient of Conv3d): weight (in_channels, out_channels / groups, kd, kh, kw)."""

  def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, output_padding=0,
               groups: int = 1, bias: bool = True, dilation=1, padding_mode: str = "zeros", device=None,
               dtype=None) -> None:
    super().__init__(3, in_channels, out_channels, kernel_size, stride, padding, dilation, True, output_padding,
                     groups, bias, padding_mode, device, dtype)

  def forward(self, input: Tensor) -> Tensor:
    return F.conv_transpose3d(input, self.weight, self.bias, self.stride, self.padding, self.output_padding,
                              self.groups, self.dilation)


class _Pool(Module):
  """Pooling options as PyTorch keeps them (stride defaults to kernel_size); those in `options` are printed too."""

  def __init__(self, kernel_size, stride=None, padding=0, **options) -> None:
    super().__init__()
    self.kernel_size, self.stride, self.padding = kernel_size, stride if stride is not None else kernel_size, padding
    self._options = list(options)
    for k, v in options.items(): setattr(self, k, v)

  def extra_repr(self) -> str:
    return ", ".join([f"kernel_size={self.kernel_size}", f"stride={self.stride}", f"padding={self.padding}"] +
                     [f"{k}={getattr(self, k)}" for k in self._options])


class MaxPool1d(_Pool):
  """The maximum over sliding windows of (N, C, L)."""

  def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False,
               ceil_mode: bool = False) -> None:
    super().__init__(kernel_size, stride, padding, dilation=dilation, ceil_mode=ceil_mode)
    self.return_indices = return_indices

  def forward(self, input: Tensor):
    return F.max_pool1d(input, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode,
                        self.return_indices)


class MaxPool2d(MaxPool1d):
  """The maximum over sliding windows of (N, C, H, W); padding counts as -inf."""

  def forward(self, input: Tensor):
    return F.max_pool2d(input, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode,
                        self.return_indices)


class AvgPool1d(_Pool):
  """The mean over sliding windows of (N, C, L)."""

  def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True) -> None:
    super().__init__(_ntuple(kernel_size, 1), _ntuple(stride if stride is not None else kernel_size, 1),
                     _ntuple(padding, 1))
    self.ceil_mode, self.count_include_pad = ceil_mode, count_include_pad

  def forward(self, input: Tensor) -> Tensor:
    return F.avg_pool1d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad)


class AvgPool2d(_Pool):
  """The mean over sliding windows of (N, C, H, W); zero padding counts in the divisor unless count_include_pad=False."""

  def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: int | None = None) -> None:
    super().__init__(kernel_size, stride, padding)
    self.ceil_mode, self.count_include_pad, self.divisor_override = ceil_mode, count_include_pad, divisor_override

  def forward(self, input: Tensor) -> Tensor:
    return F.avg_pool2d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
                        self.divisor_override)


class AdaptiveAvgPool1d(Module):
  """(N, C, L) -> (N, C, output_size): the mean over nearly equal windows."""

  def __init__(self, output_size) -> None:
    super().__init__()
    self.output_size = output_size

  def forward(self, input: Tensor) -> Tensor: return F.adaptive_avg_pool1d(input, self.output_size)
  def extra_repr(self) -> str: return f"output_size={self.output_size}"


class AdaptiveAvgPool2d(AdaptiveAvgPool1d):
  """(N, C, H, W) -> (N, C, *output_size) (None keeps a dim): the mean over nearly equal windows."""
  def forward(self, input: Tensor) -> Tensor: return F.adaptive_avg_pool2d(input, self.output_size)
