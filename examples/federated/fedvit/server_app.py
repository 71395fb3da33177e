"""fedvit's ServerApp: symmerge's AlignedFedAvg, used exactly like Flower's FedAvg, with a central
evaluation of the global model on the test set after every round."""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedvit import task
from symmerge.federated import Aggregation, AlignedFedAvg, ClientAlignment, OutlierPolicy

LAST_RUN: dict = {}  # the latest run's strategy and result (for a caller in the same process)


def strategy_options(cfg: dict) -> dict:
    """:class:`AlignedFedAvg`'s keyword arguments (besides the template) from the app's settings: its options
    objects and FedAvg's own keywords."""
    rule = str(cfg["outlier-rule"])
    return dict(alignment=ClientAlignment(cfg["align"], min_align_gain=float(cfg["min-align-gain"])),
                aggregation=Aggregation(cfg["aggregation"], trim=float(cfg["trim"]), min_clients=cfg["min-clients"]),
                outliers=OutlierPolicy(norm_factor=float(cfg["norm-factor"]) or None, norm_clip=cfg["norm-clip"],
                                       rule=None if rule == "none" else rule, threshold=float(cfg["outlier-threshold"]),
                                       data=task.server_images(cfg) if rule == "consensus" else None),
                fraction_train=float(cfg["fraction-train"]),
                fraction_evaluate=float(cfg["fraction-evaluate"]))


def make_app(overrides: dict | None = None, output: str | None = None) -> ServerApp:
    """A ServerApp whose settings are :data:`task.DEFAULTS` < the run config < ``overrides``;
    ``output``: a JSON file for the per-round record."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        cfg = task.settings(context.run_config, overrides)
        model = task.load_model(cfg)
        test_images, test_labels = task.load_test(cfg)

        def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            m = task.load_model(cfg)
            m.load_state_dict(arrays.to_torch_state_dict())
            loss, acc = task.evaluate(m, test_images, test_labels)
            return MetricRecord({"test_loss": loss, "test_acc": acc})

        strategy = AlignedFedAvg(template=model, **strategy_options(cfg))
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                                num_rounds=int(cfg["num-server-rounds"]), evaluate_fn=central_evaluate)
        LAST_RUN.update(strategy=strategy, result=result, settings=cfg)
        if output:
            record = {"settings": cfg, "rounds": strategy.rounds,
                      "test": {r: dict(m) for r, m in result.evaluate_metrics_serverapp.items()}}
            Path(output).write_text(json.dumps(record, indent=2, default=str) + "\n")

    return app


app = make_app()
