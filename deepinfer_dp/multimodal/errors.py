"""What the front ends need to know of image failures, without importing Pillow or torch."""

# The start of every error a request's images end it with (fetch, decode, processor, the
# expanded prompt's length): front ends report those as the caller's bad input (offline a
# ValueError, online a 400), naming the image or the field that carried it.
MM_ERROR_PREFIX = "invalid image input: "


def image_error_field(error: str) -> str | None:
    """The request field an image error names ("messages.0.content.1.image_url"), if any."""
    head = error.removeprefix(MM_ERROR_PREFIX).split(":", 1)[0]
    return head if head.startswith("messages.") else None
