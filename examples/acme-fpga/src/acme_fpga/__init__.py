"""ACME FPGA cards for dra-agent: an example of a backend plugin maintained outside the agent."""
