"""What a user would deploy without tserve: `transformers`' image-classification pipeline behind a minimal
FastAPI app, served by uvicorn. Takes the same request as tserve's `/v1/classifications` (a base64 image)
so that `bench/vit.py` drives both with the same client.

    python bench/hf_pipeline_server.py --model DIR --port 8123 --threads 2
"""

# No `from __future__ import annotations`: FastAPI reads the request body's type from the live annotation.
import argparse
import base64
import io


def make_app(model_dir: str):  # noqa: ANN201 - a FastAPI app
    from fastapi import FastAPI
    from PIL import Image
    from pydantic import BaseModel
    from transformers import pipeline

    classify = pipeline("image-classification", model=model_dir, device="cpu")
    app = FastAPI()

    class Body(BaseModel):
        image: str

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    @app.post("/v1/classifications")
    def classifications(body: Body) -> dict:
        image = Image.open(io.BytesIO(base64.b64decode(body.image))).convert("RGB")
        return {"predictions": classify(image, top_k=1)}

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch
    import uvicorn

    torch.set_num_threads(args.threads)
    uvicorn.run(make_app(args.model), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
