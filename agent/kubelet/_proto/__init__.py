"""Generated gRPC stubs for the kubelet's plugin-registration, DRA and DRA-health services.

Never edit the *_pb2* files by hand: change the .proto files beside them and run scripts/generate-protos.
Only agent/kubelet/services.py imports this package.
"""
