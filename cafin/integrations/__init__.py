"""Training-framework integrations, each imported on its own so that `import cafin` stays light:

- `cafin.integrations.huggingface`: `CafinTrainer` (a `transformers.Trainer` that builds any cafin
  member from `optimizer_cls_and_kwargs`) and `PreconditionerCallback` (a `TrainerCallback` that
  runs a K-FAC or two-level K-FAC preconditioner before each optimizer step and keeps its state
  in the Trainer's checkpoints).
- `cafin.integrations.lightning`: `PreconditionerCallback`, the same as a Lightning `Callback`
  (cafin optimizers returned from `configure_optimizers` need nothing: they take closures);
  `cafin.integrations.pytorch_lightning` holds the same class for the `pytorch_lightning`
  namespace.

Recipes: docs/integrations.md.
"""
