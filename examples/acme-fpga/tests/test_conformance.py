"""The acme-fpga-card backend passes dra-agent's conformance kit on the example node."""

from simulator.conformance import BackendSuite, BadClaimConfig

FPGA_CONFIG = {"apiVersion": "fpga.acme.example/v1", "kind": "FpgaConfig"}


class TestAcmeFpgaCard(BackendSuite):
    backend = "acme-fpga-card"
    profile = "../acme-node.yaml"
    claim_config = FPGA_CONFIG | {"bitstream": "inference"}
    bad_claim_configs = (BadClaimConfig(FPGA_CONFIG | {"bitstream": "/tmp/mine.bit"}, "bitstream"),)
