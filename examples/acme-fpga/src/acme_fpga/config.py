"""The backend's settings (`backend_config.acme-fpga-card`) and the opaque parameters a claim can give a card."""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, ConfigDict, Field

from backends.plugin import BackendConfig, OpaqueConfig

__all__ = ["API_VERSION", "AcmeFpgaSettings", "FpgaConfig", "PciId"]

API_VERSION = "fpga.acme.example/v1"

_PCI_ID = re.compile(r"[0-9a-f]{4}:[0-9a-f]{4}")


def _pci_id(text: str) -> str:
    text = text.lower()
    if not _PCI_ID.fullmatch(text):
        raise ValueError(f"{text!r} is not a PCI id: write vendor:device in hex, e.g. acce:0f01")
    return text


PciId = Annotated[str, AfterValidator(_pci_id)]


class AcmeFpgaSettings(BackendConfig):
    """`backend_config.acme-fpga-card`.

    `ids` lists the PCI ids (`vendor:device`, hex) of the cards to publish, default the ACME F1 (`acce:0f01`).
    Cards must be bound to the `acme_fpga` driver: their device nodes come from it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    ids: tuple[PciId, ...] = Field(default=("acce:0f01",), min_length=1, max_length=16)


Bitstream = Literal["crypto", "inference", "video"]


class FpgaConfig(OpaqueConfig):
    """`apiVersion: fpga.acme.example/v1`, `kind: FpgaConfig`: what to load on the card for the claim.

    `bitstream` names one of the images the card's flash holds (`crypto`, `inference`, `video`); the card gets
    it at prepare and its factory image back at unprepare. A claim without FpgaConfig gets the card as it is.
    """

    API_VERSION: ClassVar[str] = API_VERSION
    KIND: ClassVar[str] = "FpgaConfig"

    bitstream: Bitstream
