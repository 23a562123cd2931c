"""The Python authoring API: workflows, steps, retry policies and the registry."""
