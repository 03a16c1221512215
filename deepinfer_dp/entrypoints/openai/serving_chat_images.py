"""Chat requests with image_url parts, for a model that takes images. The conversation goes
through the model's processor's chat template off the event loop (the engine's at dp 1, the
client's ImageFront behind the router, which also checks each URL's scheme and allowed folder);
the images themselves are fetched, decoded and preprocessed by the image worker of the engine
that runs the request, and a bad one answers 400 naming its field
(`messages.0.content.1.image_url`) before any token is streamed."""

from __future__ import annotations

from deepinfer_dp.entrypoints.openai.protocol import ChatCompletionRequest
from deepinfer_dp.entrypoints.openai.serving_engine import ServingContext, bad_request
from deepinfer_dp.multimodal.media import MediaError
from deepinfer_dp.utils.chat_template import ChatRender


async def image_prompt(ctx: ServingContext, req: ChatCompletionRequest, render: ChatRender):
    """The request's MultiModalPrompt, or None when it has no image parts or the model takes
    none (the text path then refuses the parts by name, as for any model without vision)."""
    found = [(i, j) for i, m in enumerate(req.messages) if isinstance(m.content, list)
             for j, part in enumerate(m.content) if part.type == "image_url"]
    images = getattr(ctx.client, "images", None)
    if not found or images is None:
        return None
    if len(found) > ctx.client.image_limit:
        i, j = found[ctx.client.image_limit]
        raise bad_request(f"{len(found)} images in one prompt, more than --limit-mm-per-prompt allows "
                          f"({ctx.client.image_limit})", f"messages.{i}.content.{j}.image_url")
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        return await ctx.off_loop(images.chat_prompt, messages, render)
    except MediaError as e:
        param = str(e).split(":", 1)[0]
        raise bad_request(str(e), param if param.startswith("messages.") else "messages") from e
    except Exception as e:  # noqa: BLE001 - the template refuses a conversation in its own ways
        raise bad_request(f"the chat template failed: {e}", "messages") from e
