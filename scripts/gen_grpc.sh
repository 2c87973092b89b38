#!/usr/bin/env bash
# Regenerate the gRPC stubs of the Open Inference Protocol from
# src/slimline/serve/proto/grpc_predict_v2.proto. Use a grpcio-tools whose bundled protobuf has
# the same major.minor as the protobuf runtime installed (the generated code checks it at import):
#   pip install "grpcio-tools>=1.78,<1.80"   # protobuf 6, as tritonclient[grpc] needs
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=src/slimline/serve/proto
"$PY" -m grpc_tools.protoc -I "$OUT" --python_out="$OUT" --pyi_out="$OUT" \
    --grpc_python_out="$OUT" "$OUT/grpc_predict_v2.proto"
# the generated service module imports its messages as a top-level module; make it relative
sed -i 's/^import grpc_predict_v2_pb2 as/from . import grpc_predict_v2_pb2 as/' \
    "$OUT/grpc_predict_v2_pb2_grpc.py"
# a private descriptor pool: tritonclient's service_pb2 declares the same `inference.*` messages
# in the default pool, and both load in one process (the tests, a client beside a server)
sed -i 's/^DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile/DESCRIPTOR = _descriptor_pool.DescriptorPool().AddSerializedFile/' \
    "$OUT/grpc_predict_v2_pb2.py"
grep -q '_descriptor_pool.DescriptorPool()' "$OUT/grpc_predict_v2_pb2.py"
