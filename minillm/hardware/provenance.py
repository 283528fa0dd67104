"""Who measured what, and where: the fields every result file of the project starts with (the model,
its dtype, the device, the hardware, the host, the versions, the command), written once so a sweep,
a prefill run and any later result record them the same way."""
from __future__ import annotations

import platform
import socket
from dataclasses import asdict, dataclass

from minillm.core.result import Result
from minillm.hardware.machine import HardwareInfo


def hardware_dict(hw: HardwareInfo) -> dict:
    """The hardware as plain data, with its one-line summary."""
    d = asdict(hw)
    d["summary"] = hw.summary()
    return d


@dataclass
class RunProvenance(Result):
    """The first fields of a result (a dataclass inheriting this keeps them first, flat in its JSON)."""
    model: str
    dtype: str
    device: str
    hardware: dict
    host: str
    torch_version: str
    python: str
    command: str

    @staticmethod
    def here(model: str, dtype: str, device: str, hw: HardwareInfo, command: str) -> dict:
        """The provenance fields of a run on this machine, now, as keyword arguments."""
        import torch
        return dict(model=model, dtype=dtype, device=device, hardware=hardware_dict(hw),
                    host=socket.gethostname(),
                    torch_version=torch.__version__, python=platform.python_version(), command=command)
