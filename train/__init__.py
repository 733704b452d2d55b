"""Training the speculation module (PDM): offline data, decontamination, draft vocabulary, distillation."""
