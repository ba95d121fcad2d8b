"""The audit harness: drives the engine (deepinfer) over suites and configurations and writes what it
served to the audit store (audit). Dependencies point one way: kernels <- deepinfer <- harness -> audit.

- suites: `suites` (the registry of kinds and `load_suite`), `suite_base` (the types every kind builds
  on), `traces` with `trace_import` / `trace_export` (agent episodes), `lm_eval_suite` (lm-eval tasks);
- runs: `sweep` (configurations), `serve` (arrival order), `record` and `run_writer` (run folders),
  `environment` (what the manifest says about the machine), `certify` (a sweep, compared and sealed),
  `invariance` (the invariance matrix);
- lm-eval: `lm_eval_model` (`DeepInferLM`), `lm_eval_requests`, `evaluate`;
- agent replay: `replay`, `cassette`;
- the `deepinfer audit` and `deepinfer lm-eval` commands: `cli`, `eval_cli`, `replay_cli`, `lm_eval_cli`.
"""
