"""`radixmesh loadtest`: drive a running cluster with synthetic and real traffic, and report."""
