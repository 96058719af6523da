"""The gRPC wire: .proto sources and the Python modules generated from them."""
