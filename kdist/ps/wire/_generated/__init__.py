"""Stubs generated from `kdist/ps/wire/protos/variable_service.proto`; do not edit (`python -m kdist.rpc.regenerate`)."""
