"""Generated stubs of the Open Inference Protocol over gRPC; regenerate with scripts/gen_grpc.sh."""
