"""`dra-agent demo`: the whole path of a claim on simulated nodes, told as it happens."""
