"""The real pretrained model benchmarks (RapidOCR): QAT beside onnxruntime's and the peers' quantizers."""
