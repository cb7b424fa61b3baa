"""Capturing a call in a CUDA graph the way training code does: on a side stream that first waits
for the current one, which then waits for the capture (the tests of captured steps share it)."""

import torch


def capture_on_side_stream(fn):
    """``fn()`` captured in a new ``torch.cuda.CUDAGraph`` on a side stream; returns the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    return graph
