"""The mathematics of alignment, independent of any model family or kind: specs (data), binding a spec
to a state dict, applying elements, distances, layouts, and the closed-form solvers."""
