"""Machine code built at load from LLVM IR (llvmlite, which numba brings): for kernels whose
inner loops need vector operations numba's vectorizer does not emit, or an order of float
operations it does not keep (`service/kernels/int8_kernel.py`,
`service/kernels/attention_kernel.py`)."""

from __future__ import annotations

import ctypes
from typing import Any

_engines: list[Any] = []  # an execution engine must outlive every call of its code


def compile_ir(module_text: str, name: str, argtypes: list[Any]) -> Any:
    """The function `name` of the IR module `module_text`, compiled for this CPU (all its
    features, -O3), as a ctypes function returning nothing; numba's jitted code can call it."""
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    target = llvm.Target.from_triple(llvm.get_process_triple())
    machine = target.create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3
    )
    module = llvm.parse_assembly(module_text)
    module.verify()
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    function = ctypes.CFUNCTYPE(None, *argtypes)(engine.get_function_address(name))
    _engines.append((engine, function))
    return function
