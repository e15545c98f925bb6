"""sentence-transformers integration (optional: ``pip install lmk_ops[st]``).

``LandmarkTransformer`` is a ``sentence_transformers`` Transformer module that tokenizes with landmarks (untruncated,
landmarks inserted, then truncated to ``max_seq_length``) and passes the ``landmark_mask`` on; ``LandmarkPooling``
pools with lmk_ops. Both save with ``model.save(path)`` and load back with ``SentenceTransformer(path,
trust_remote_code=True)`` (sentence-transformers asks for it before importing a module class from outside its own
package, an installed one included)::

    from sentence_transformers import SentenceTransformer
    from lmk_ops.sentence_transformers import LandmarkPooling, LandmarkTransformer

    model = SentenceTransformer(modules=[LandmarkTransformer(path, interval=32), LandmarkPooling("lmk")])
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from sentence_transformers.base.modules.module import Module
    from sentence_transformers.base.modules.transformer import Transformer
except ImportError as error:  # before 6.0 these modules, and the preprocess() API used here, did not exist
    import sentence_transformers

    raise ImportError(f"lmk_ops.sentence_transformers: expected sentence-transformers >= 6, got "
                      f"{sentence_transformers.__version__} (pip install 'lmk_ops[st]')") from error

from ._checks import is_int
from .hf import cut_before_insertion, insert_for_tokenizer, landmark_token_id, special_token_layout
from .nn import Pooling

__all__ = ["LandmarkPooling", "LandmarkTransformer"]


class LandmarkTransformer(Transformer):
    """A Transformer module whose tokenization inserts landmarks.

    Args:
        model_name_or_path: as for ``sentence_transformers.models.Transformer``.
        landmark_token: the landmark token; None reuses the SEP token (else EOS). A token not in the vocabulary is
            an error: add it first (``lmk_ops.hf.add_landmark_token``) and resize the model's embeddings.
        interval: content tokens per chunk.
        **kwargs: passed to ``Transformer`` (``max_seq_length``, ``model_kwargs``, ...).
    """

    config_keys = [*Transformer.config_keys, "landmark_token", "interval"]

    def __init__(self, model_name_or_path: str, *, landmark_token: str | None = None, interval: int = 32, **kwargs):
        if not is_int(interval) or interval < 1:  # else the first encode() would fail, far from here
            raise ValueError(f"lmk_ops.sentence_transformers.LandmarkTransformer: expected interval as an int >= 1, "
                             f"got {interval!r}")
        super().__init__(model_name_or_path, **kwargs)
        self.landmark_token = landmark_token
        self.interval = int(interval)
        tokenizer = self._text_tokenizer()
        self._landmark_id = landmark_token_id(tokenizer, landmark_token)
        self._layout = special_token_layout(tokenizer)

    def _text_tokenizer(self) -> Any:
        """The model's tokenizer: landmarks go into token ids, so a model without one (sentence-transformers gives
        None for a processor that is not a text one) is refused."""
        if self.tokenizer is None:
            raise ValueError(f"lmk_ops.sentence_transformers.LandmarkTransformer: expected a text model with a "
                             f"tokenizer, got a processor of type {type(getattr(self, 'processor', None)).__name__}")
        return self.tokenizer

    def preprocess(self, inputs, prompt=None, processing_kwargs=None, **kwargs) -> dict[str, Any]:
        # Landmarks go in first and the result is truncated after, so the tokenizer cuts only what that truncation
        # drops anyway (cut_before_insertion).
        max_length = kwargs.get("max_length") or self.max_seq_length
        cut = cut_before_insertion(max_length, self._layout)
        processing_kwargs = dict(processing_kwargs or {})
        # verbose=False: the tokenizer would warn that a text cut longer than max_length is too long for the model,
        # which it is not once truncated below.
        processing_kwargs["text"] = {**processing_kwargs.get("text", {}), "truncation": cut is not None,
                                     "max_length": cut, "verbose": False}
        features = super().preprocess(inputs, prompt, processing_kwargs, **kwargs)
        if "input_ids" not in features:
            return features
        batch = insert_for_tokenizer(
            self._text_tokenizer(), features["input_ids"], features["attention_mask"], landmark_id=self._landmark_id,
            layout=self._layout, interval=self.interval, max_length=max_length)
        features.update(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        landmark_mask=batch.landmark_mask)
        if prompt and "prompt_length" in features:
            features["prompt_length"] = self._prompt_length_with_landmarks(prompt)
        if "token_type_ids" in features:  # one segment per text: all zeros, at the new length
            features["token_type_ids"] = torch.zeros_like(batch.input_ids)
        return features

    def _prompt_length_with_landmarks(self, prompt: str) -> int:
        """The tokens a prompt takes at the start of each text once landmarks are in: its leading special tokens,
        its content tokens and the landmarks of the chunks it fills. (sentence-transformers measures the prompt by
        preprocessing it alone, which here inserts landmarks into it as into a text of its own, and drops its last
        token if special: with the SEP token as the landmark, one token short where the prompt fills its last
        chunk, whose landmark is then the text's closing [SEP].) A pooling module with include_prompt=False leaves
        these tokens out."""
        content = len(self._text_tokenizer()(prompt, add_special_tokens=False)["input_ids"])
        return self._layout[0] + content + content // self.interval

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        # The landmark mask is for the pooling module, not the model.
        landmark_mask = features.pop("landmark_mask", None)
        features = super().forward(features, **kwargs)
        if landmark_mask is not None:
            features["landmark_mask"] = landmark_mask
        return features


class LandmarkPooling(Module):
    """A sentence-transformers pooling module backed by :class:`lmk_ops.nn.Pooling`.

    Args:
        mode: "mean", "max", "cls"/"first", "last", "mean_sqrt_len_tokens", "weightedmean", "lmk" (needs
            :class:`LandmarkTransformer` before it) or "attention" (a learned query per head, trained with the
            model; needs ``dim``). Padded or flattened features (``cu_seq_lens_q``) alike.
        normalize: L2-normalise the embeddings inside the op.
        dim, heads: for "attention": the token states' width and the number of heads (dividing it).
        include_prompt: False leaves out the prompt's tokens (and its landmarks), as sentence-transformers'
            ``Pooling(include_prompt=False)`` does, when the features carry ``prompt_length``
            (``model.encode(texts, prompt=...)``); see :class:`lmk_ops.nn.Pooling`.

    ``model.save(path)`` writes the config and, for "attention", the query's weights beside it.
    """

    config_keys = ["mode", "normalize", "dim", "heads", "include_prompt"]

    def __init__(self, mode: str = "lmk", normalize: bool = False, dim: int | None = None, heads: int = 1,
                 include_prompt: bool = True):
        super().__init__()
        # Pooling checks the arguments.
        self.pooling = Pooling(mode, normalize=normalize, dim=dim, heads=heads, include_prompt=include_prompt)
        self.mode = mode
        self.normalize = self.pooling.normalize  # bools, as the saved config holds them
        self.include_prompt = self.pooling.include_prompt
        self.dim = dim
        self.heads = heads

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        features["sentence_embedding"] = self.pooling(features["token_embeddings"], features)
        return features

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        self.save_config(output_path)
        if self.mode == "attention":
            self.save_torch_weights(output_path, safe_serialization=safe_serialization)

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", token: bool | str | None = None,
             cache_folder: str | None = None, revision: str | None = None, local_files_only: bool = False,
             init_defaults: dict[str, Any] | None = None, **kwargs) -> LandmarkPooling:
        hub: dict[str, Any] = {"subfolder": subfolder, "token": token, "cache_folder": cache_folder,
                               "revision": revision, "local_files_only": local_files_only}
        module = super().load(model_name_or_path, init_defaults=init_defaults, **hub, **kwargs)  # from its config
        if module.mode == "attention":
            module = cls.load_torch_weights(model_name_or_path, model=module, **hub)
        return module
