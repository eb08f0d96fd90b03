"""Bytes on the wire: tensor codecs and their registry, message framing, chunked streams, gRPC channels,
and the per-link codec choice. Imports only ``swarmpipe.protos``; everything above builds on it."""
