"""The agent's side of the kubelet: the DRA and registration gRPC services on unix sockets and the health stream."""
