"""An AOTInductor graph called through its C ABI with ctypes, which drops the GIL for the call.

torch's own runner (`torch._C._aoti.AOTIModelPackageLoader.boxed_run`) holds the GIL for the whole
forward: with the engine in a thread of the server's process, the event loop then waits a whole
step for it — `/health` and `/metrics` answer a step late (measured: a 0.5 ms sleep in the loop
thread overshot by 24 ms at p90 while 64-sequence decode steps ran), and the HTTP work of a
step's tokens runs after the step instead of beside it.

The package's model library exports a stable C ABI (torch/csrc/inductor/aoti_runtime/
interface.h): a container is created from it, handed the worker's parameters as user-managed
constants (no copy, the same as `load_constants(..., user_managed=True)`), and run with tensor
handles. A ctypes call releases the GIL, so the forward runs while Python threads go on.

For graphs whose code calls no Python: the decode graphs. The chunk graph calls the attention op
(`kvscale::unified_attention`, a Python custom op) through torch's proxy executor, which this
runner does not have; it stays on torch's runner.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch


class AOTIError(RuntimeError):
    """A call into the model library failed (its message is on stderr, from the library)."""


class _Entry(ctypes.Structure):  # AOTInductorConstantMapEntry
    _fields_ = [("name", ctypes.c_char_p), ("handle", ctypes.c_void_p)]


# torch hands tensor handles to Python as capsules (pybind's void*) and takes them back the same way.
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype, _capsule_new.argtypes = (
    ctypes.py_object,
    [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p],
)


def tensor_handles(tensors: list[torch.Tensor]) -> list[int]:
    """New AtenTensorHandles (owned at::Tensor copies: same storage) for tensors, as addresses."""
    return [_capsule_pointer(c, None) for c in torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(tensors)]


def steal_tensors(handles) -> list[torch.Tensor]:
    """The tensors of AtenTensorHandles (addresses), the handles freed."""
    return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
        [_capsule_new(h, None, None) for h in handles]
    )


def model_library(package: Path, into: Path) -> Path:
    """Extract the package's model library (`*.wrapper.so`) into folder `into`; returns its path."""
    with zipfile.ZipFile(package) as archive:
        names = [n for n in archive.namelist() if n.endswith(".wrapper.so")]
        if len(names) != 1:
            raise AOTIError(f"{package}: expected one model library, found {len(names)}")
        target = into / Path(names[0]).name
        with archive.open(names[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)  # in pieces: a big model's library is not read whole
    return target


class ReleasedGILRunner:
    """One AOTInductor graph of a package, run through ctypes (the GIL released while it runs).
    `constants`: the graph's constants by their original names (the module's parameter and buffer
    names), the same mapping torch's `load_constants` takes."""

    def __init__(self, package: Path, constants: dict[str, torch.Tensor]) -> None:
        self._handle = ctypes.c_void_p()
        self._constant_handles: list[int] = []  # set before anything can fail: close() reads them
        with tempfile.TemporaryDirectory(prefix="kvscale-aoti-") as folder:
            # Mapped once loaded: the file itself can go with the folder.
            self._lib = ctypes.CDLL(str(model_library(package, Path(folder))), mode=os.RTLD_LOCAL)
        lib = self._lib
        for name in ("AOTInductorModelContainerCreateWithDevice", "AOTInductorModelContainerRun",
                     "AOTInductorModelContainerGetNumOutputs", "AOTInductorModelContainerGetNumConstants",
                     "AOTInductorModelContainerGetConstantName",
                     "AOTInductorModelContainerGetConstantOriginalFQN",
                     "AOTInductorModelContainerUpdateUserManagedConstantBufferPairs",
                     "AOTInductorModelContainerDelete"):  # fmt: skip
            getattr(lib, name).restype = ctypes.c_int32
        self._check("CreateWithDevice", ctypes.byref(self._handle), ctypes.c_size_t(1), b"cpu", None)
        count = ctypes.c_size_t()
        self._check("GetNumOutputs", self._handle, ctypes.byref(count))
        self.num_outputs = count.value
        self._check("GetNumConstants", self._handle, ctypes.byref(count))
        names, tensors = [], []
        for i in range(count.value):
            name, fqn = ctypes.c_char_p(), ctypes.c_char_p()
            self._check("GetConstantName", self._handle, ctypes.c_size_t(i), ctypes.byref(name))
            self._check("GetConstantOriginalFQN", self._handle, ctypes.c_size_t(i), ctypes.byref(fqn))
            original = (fqn.value or name.value or b"").decode()
            if original not in constants:
                raise AOTIError(f"{package}: the graph wants a constant this model lacks: {original}")
            names.append(name.value)
            tensors.append(constants[original])
        # The container keeps shallow handles to these tensors (user-managed: no copy); the handles
        # stay ours, alive as long as the container.
        self._constant_handles = tensor_handles(tensors)
        self._names = names  # the c_char_p entries point into these bytes
        entries = [_Entry(n, h) for n, h in zip(names, self._constant_handles, strict=True)]
        pairs = (_Entry * len(entries))(*entries)
        self._check("UpdateUserManagedConstantBufferPairs", self._handle, pairs, ctypes.c_size_t(len(names)),
                    ctypes.c_bool(False), ctypes.c_bool(True))  # fmt: skip

    def _check(self, function: str, *args) -> None:
        code = getattr(self._lib, f"AOTInductorModelContainer{function}")(*args)
        if code != 0:
            raise AOTIError(f"AOTInductorModelContainer{function} failed (error {code})")

    def boxed_run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The graph's outputs for inputs (flat, in the exported order), the GIL released meanwhile."""
        handles = tensor_handles(inputs)  # stolen by the run
        inputs.clear()  # as torch's boxed_run: the graph may free an input it no longer needs
        outputs = (ctypes.c_void_p * self.num_outputs)()
        self._check("Run", self._handle, (ctypes.c_void_p * len(handles))(*handles),
                    ctypes.c_size_t(len(handles)), outputs, ctypes.c_size_t(self.num_outputs),
                    None, None)  # fmt: skip
        return steal_tensors(outputs)

    def close(self) -> None:
        if self._handle:
            self._check("Delete", self._handle)
            self._handle = ctypes.c_void_p()
            steal_tensors(self._constant_handles)  # frees them
            self._constant_handles = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the library may be gone
            self.close()
