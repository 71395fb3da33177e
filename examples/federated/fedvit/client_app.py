"""fedvit's ClientApp: train the received global model on the node's shard, reply as Flower's PyTorch
quickstart does (the state dict as the ``arrays`` ArrayRecord, ``num-examples`` in the metrics)."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedvit import task


def make_app(overrides: dict | None = None) -> ClientApp:
    """A ClientApp whose settings are :data:`task.DEFAULTS` < the run config < ``overrides``."""
    app = ClientApp()

    def setup(msg: Message, context: Context):
        cfg = task.settings(context.run_config, overrides)
        model = task.load_model(cfg)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        pid, parts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
        return cfg, model, pid, parts

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg, model, pid, parts = setup(msg, context)
        server_round = int(msg.content["config"]["server-round"])
        x, y = task.load_partition(pid, parts, cfg)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        attack = pid == int(cfg["attack-partition"]) and server_round >= int(cfg["attack-round"])
        flip = attack and cfg["attack"] == "flip"  # trains on flipped labels
        loss = task.train(model, x, int(model.config.num_labels) - 1 - y if flip else y, cfg,
                          seed=1000 * server_round + pid)
        sd = model.state_dict()
        if attack and not flip:
            if cfg["attack"] == "scale100":
                sd = {k: start[k] + 100.0 * (v - start[k]) for k, v in sd.items()}
            elif cfg["attack"] == "nan":
                sd = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
            else:
                raise ValueError(f"unknown attack {cfg['attack']!r}")
        content = RecordDict({"arrays": ArrayRecord(sd),
                              "metrics": MetricRecord({"train_loss": loss, "num-examples": len(x)})})
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        cfg, model, pid, parts = setup(msg, context)
        x, y = task.load_partition(pid, parts, cfg)
        with torch.no_grad():
            logits = model(pixel_values=x).logits
        loss = torch.nn.functional.cross_entropy(logits, y).item()
        acc = (logits.argmax(-1) == y).float().mean().item()
        content = RecordDict({"metrics": MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": len(x)})})
        return Message(content=content, reply_to=msg)

    return app


app = make_app()
