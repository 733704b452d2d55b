"""The Python API: `LLM(...).generate(prompts, SamplingParams(...))`, shaped after vLLM's offline API."""
