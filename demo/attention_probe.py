"""Attention supervision for demo-vl's lookup questions (stage 4 of train_vl).

"What color is the {shape}?" and "What shape is the {color} object?" need the language model to find one
object by one attribute. After stages 1-3 it had not learnt to, so stage 4 tells two attention heads where
to look: binding_targets() computes the positions from a batch, AttentionProbe scores the heads' maps.
"""

from __future__ import annotations

import torch

from tessera.demo import scenes


def binding_targets(processor, samples, ids, labels, labs) -> dict[str, torch.Tensor]:
    """Where the two attention hops of a lookup question should look (stage 4, see AttentionProbe).

    "What color is the circle?": hop 1 goes from the keyword token (" circle") to the image tokens of
    that object; hop 2 from the position that predicts the answer back to the keyword. Samples of other
    question types get query position -1 and no loss.
    """
    b, n = ids.shape
    q1, q2 = torch.full((b,), -1), torch.full((b,), -1)
    t1, t2 = torch.zeros(b, n, dtype=torch.bool), torch.zeros(b, n, dtype=torch.bool)
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    colors = list(scenes.COLORS)
    for i, s in enumerate(samples):
        if s.kind != "image" or s.question_type not in ("color", "shape"):
            continue
        scene = s.scenes[0]
        word = s.question.rstrip("?").split()[-1 if s.question_type == "color" else -2]
        obj = next(sh for sh in scene.shapes if word in (sh.kind, sh.color))
        keyword = processor.tokenizer.convert_tokens_to_ids("\u0120" + word)
        image_pos = (ids[i] == image_id).nonzero().flatten()
        on_obj = torch.from_numpy(labs[i]["color"] == 1 + colors.index(obj.color))
        if not bool(on_obj.any()):
            continue
        after = int(image_pos[-1]) + 1
        q1[i] = after + int((ids[i, after:] == keyword).nonzero()[0])
        t1[i, image_pos[on_obj]] = True
        q2[i] = int((labels[i] >= 0).nonzero()[0]) - 1  # the first labelled (answer) token, minus one
        t2[i, q1[i]] = True
    return {"bind_q1": q1, "bind_t1": t1, "bind_q2": q2, "bind_t2": t2}


def capture_attention(model, layers: list[int]) -> dict[int, torch.Tensor]:
    """{layer: its attention weights [batch, heads, queries, keys] of the model's latest forward}, kept up to date
    by hooks on those language-model layers (eager attention returns the weights)."""
    maps: dict[int, torch.Tensor] = {}
    blocks = model.model.language_model.layers
    for layer in layers:
        blocks[layer].self_attn.register_forward_hook(lambda m, i, o, layer=layer: maps.__setitem__(layer, o[1]))
    return maps


class AttentionProbe:
    """Captures attention maps of two language-model layers and scores them against the lookup targets.

    Why: after stage 3, "What color is the {shape}?" was at chance on 2- and 3-shape scenes (48% and
    28% on 200 fresh questions, 100% with one shape) while "Describe the image." named every object
    right in 86%: the model never learnt to find an object by one attribute. One head of layer 0
    is taught to attend from the keyword to that object's image tokens, and one head of layer 2 from the
    answer position to the keyword (a negative log of the attention mass on the targets).
    """

    def __init__(self, model, hops=((0, "bind_q1", "bind_t1"), (2, "bind_q2", "bind_t2")), head: int = 0):
        self.hops, self.head = hops, head
        self.maps = capture_attention(model, [layer for layer, _, _ in hops])

    def loss(self, batch: dict) -> torch.Tensor:
        total = torch.zeros(())
        for layer, q_key, t_key in self.hops:
            q, targets, weights = batch[q_key], batch[t_key], self.maps.get(layer)
            rows = (q >= 0).nonzero().flatten()
            if weights is None or len(rows) == 0:
                continue
            attn = weights[rows, self.head, q[rows]]  # (rows, keys)
            mass = (attn * targets[rows]).sum(-1)
            total = total + (-torch.log(mass + 1e-6)).mean()
        return total
