"""Stubs generated from `kdist/ps/protos/variable_service.proto`; do not edit (`python -m kdist.ps.regenerate`)."""
