"""Recording a region: what its forward did, op by op (the region graph, the tracer, what each
op does, where it ran, what things are called, the decisions a node can get). docs/design.md."""
