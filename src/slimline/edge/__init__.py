"""Edge deployment: a memory-bounded runtime profile chosen by measurement
(:mod:`slimline.edge.memory`) and the edge-cloud cascade's threshold calibration
(:mod:`slimline.edge.calibrate`; the serving side is :mod:`slimline.serve.cascade`)."""
