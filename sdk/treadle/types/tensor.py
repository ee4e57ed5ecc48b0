"""TensorData: the JSON form of a tensor on the Tinker wire.

A tensor travels as a flat list of numbers plus a dtype (`int64` or `float32`) and an optional
shape. A 2-D tensor may instead be sparse CSR: `data` then holds only the listed values, and
`sparse_crow_indices` / `sparse_col_indices` say where they sit; every other entry takes a pad
value (0 unless the reader asks for another).

This module needs neither numpy nor torch. `to_numpy` / `from_numpy` import numpy when called
(install `treadle[numpy]`), and `to_torch` / `from_torch` import torch likewise.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from pydantic import model_validator

from treadle.types._base import WireRequest

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

TensorDtype: TypeAlias = Literal["int64", "float32"]


def _import_numpy() -> Any:
    try:
        import numpy
    except ImportError as exc:
        raise ImportError(
            "numpy is needed for TensorData.to_numpy/from_numpy; "
            "install it with `pip install 'treadle[numpy]'`"
        ) from exc
    return numpy


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            "torch is needed for TensorData.to_torch/from_torch; "
            "install it with `pip install 'treadle[torch]'`"
        ) from exc
    return torch


class TensorData(WireRequest):
    """A dense or CSR-sparse tensor of int64 or float32 values.

    `shape` defaults to 1-D (`[len(data)]`) for dense tensors and is required for CSR ones.
    Validation checks sizes (shape against data, CSR index lengths) but not values.
    """

    data: list[int] | list[float]
    dtype: TensorDtype
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None

    @model_validator(mode="after")
    def _check_layout(self) -> TensorData:
        if self.dtype == "float32":
            if self.data and isinstance(self.data[0], int):
                self.data = [float(x) for x in self.data]
        elif any(isinstance(x, float) for x in self.data):
            if not all(float(x).is_integer() for x in self.data):
                raise ValueError(
                    "int64 TensorData holds non-integer values; send whole numbers or "
                    "use dtype 'float32'"
                )
            self.data = [int(x) for x in self.data]
        if self.shape is not None and any(d < 0 for d in self.shape):
            raise ValueError(f"TensorData shape {self.shape} has a negative dimension")
        if (self.sparse_crow_indices is None) != (self.sparse_col_indices is None):
            raise ValueError(
                "sparse CSR TensorData needs both sparse_crow_indices and sparse_col_indices"
            )
        if self.sparse_crow_indices is None:
            if self.shape is not None and math.prod(self.shape) != len(self.data):
                raise ValueError(
                    f"TensorData shape {self.shape} needs {math.prod(self.shape)} values "
                    f"but data holds {len(self.data)}"
                )
            return self
        _check_csr(self.shape, self.sparse_crow_indices, self.sparse_col_indices or [], self.data)
        return self

    # -- properties -------------------------------------------------------------------------

    @property
    def is_sparse(self) -> bool:
        return self.sparse_crow_indices is not None

    @property
    def dense_shape(self) -> list[int]:
        """The tensor's shape, inferring 1-D `[len(data)]` when none was sent."""
        return list(self.shape) if self.shape is not None else [len(self.data)]

    @property
    def numel(self) -> int:
        return math.prod(self.dense_shape)

    # -- conversions without numpy ----------------------------------------------------------

    def dense_values(self, pad_value: int = 0) -> list[int] | list[float]:
        """Row-major flat values of the dense tensor; CSR gaps are filled with `pad_value`."""
        if self.sparse_crow_indices is None:
            return self.data
        rows, cols = self.dense_shape
        fill: int | float = float(pad_value) if self.dtype == "float32" else int(pad_value)
        out: list[Any] = [fill] * (rows * cols)
        crow, col = self.sparse_crow_indices, self.sparse_col_indices or []
        for r in range(rows):
            for j in range(crow[r], crow[r + 1]):
                out[r * cols + col[j]] = self.data[j]
        return out

    def to_dense(self, pad_value: int = 0) -> TensorData:
        """This tensor in dense form (itself when already dense)."""
        if self.sparse_crow_indices is None:
            return self
        return TensorData(
            data=self.dense_values(pad_value), dtype=self.dtype, shape=self.dense_shape
        )

    def tolist(self, pad_value: int = 0) -> list[Any]:
        """Nested Python lists in the tensor's shape."""
        flat: list[Any] = list(self.dense_values(pad_value))
        shape = self.dense_shape
        if not shape:
            return flat
        for dim in reversed(shape[1:]):
            flat = [flat[i : i + dim] for i in range(0, len(flat), dim)] if dim else []
        return flat

    @classmethod
    def from_list(cls, values: list[Any], dtype: TensorDtype) -> TensorData:
        """Build from a (possibly nested, rectangular) list of numbers."""
        shape: list[int] = []
        probe: Any = values
        while isinstance(probe, list):
            shape.append(len(probe))
            probe = probe[0] if probe else None
        flat: list[Any] = values
        for _ in range(len(shape) - 1):
            flat = [x for row in flat for x in row]
        return cls(data=flat, dtype=dtype, shape=shape)

    # -- numpy / torch (optional extras) ----------------------------------------------------

    def to_numpy(self, pad_value: int = 0) -> npt.NDArray[Any]:
        """A numpy array in the tensor's shape; CSR gaps are filled with `pad_value`."""
        np_ = _import_numpy()
        np_dtype = np_.float32 if self.dtype == "float32" else np_.int64
        if self.sparse_crow_indices is None:
            return np_.asarray(self.data, dtype=np_dtype).reshape(self.dense_shape)
        rows, cols = self.dense_shape
        out = np_.full((rows, cols), pad_value, dtype=np_dtype)
        crow = np_.asarray(self.sparse_crow_indices, dtype=np_.int64)
        row_ids = np_.repeat(np_.arange(rows), np_.diff(crow))
        col_ids = np_.asarray(self.sparse_col_indices, dtype=np_.int64)
        out[row_ids, col_ids] = np_.asarray(self.data, dtype=np_dtype)
        result: npt.NDArray[Any] = out
        return result

    @classmethod
    def from_numpy(cls, array: np.ndarray[Any, Any]) -> TensorData:
        """Float arrays become float32, integer and bool arrays int64."""
        kind = array.dtype.kind
        if kind == "f":
            dtype: TensorDtype = "float32"
        elif kind in ("i", "u", "b"):
            dtype = "int64"
        else:
            raise ValueError(
                f"cannot send a numpy array of dtype {array.dtype}; use ints or floats"
            )
        flat = array.reshape(-1).astype("float32" if dtype == "float32" else "int64")
        return cls.model_construct(
            data=flat.tolist(),
            dtype=dtype,
            shape=list(array.shape),
            sparse_crow_indices=None,
            sparse_col_indices=None,
        )

    def to_torch(self, pad_value: int = 0) -> Any:
        """A dense torch tensor (float32 or int64); CSR gaps are filled with `pad_value`."""
        torch = _import_torch()
        torch_dtype = torch.float32 if self.dtype == "float32" else torch.int64
        return torch.tensor(self.dense_values(pad_value), dtype=torch_dtype).reshape(
            self.dense_shape
        )

    @classmethod
    def from_torch(cls, tensor: Any) -> TensorData:
        """Floating tensors (bf16 included) become float32, the rest int64."""
        dtype: TensorDtype = "float32" if tensor.dtype.is_floating_point else "int64"
        values = tensor.detach().cpu().reshape(-1)
        values = values.float() if dtype == "float32" else values.long()
        return cls.model_construct(
            data=values.tolist(),
            dtype=dtype,
            shape=list(tensor.shape),
            sparse_crow_indices=None,
            sparse_col_indices=None,
        )


def _check_csr(shape: list[int] | None, crow: list[int], col: list[int], data: list[Any]) -> None:
    if shape is None or len(shape) != 2:
        raise ValueError(
            f"sparse CSR TensorData needs a 2-D shape [rows, cols], got {shape}; "
            "send the dense shape alongside the CSR indices"
        )
    rows, cols = shape
    if len(crow) != rows + 1:
        raise ValueError(
            f"sparse_crow_indices must have rows + 1 = {rows + 1} entries, got {len(crow)}"
        )
    if len(col) != len(data):
        raise ValueError(
            f"sparse_col_indices has {len(col)} entries but data holds {len(data)} values; "
            "CSR data lists exactly one value per column index"
        )
    if crow[0] != 0 or crow[-1] != len(data) or any(a > b for a, b in itertools.pairwise(crow)):
        raise ValueError(
            "sparse_crow_indices must start at 0, never decrease, and end at the number of "
            f"values ({len(data)})"
        )
    if col and (min(col) < 0 or max(col) >= cols):
        raise ValueError(f"sparse_col_indices must lie in [0, {cols}) for shape {shape}")
