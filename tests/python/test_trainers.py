"""The trainers users launch with, their model an OrtModule, against the same trainer with the eager
model: Hugging Face's Trainer (a tiny BERT from its config: trains, evaluates, save_pretrained) and
a Lightning module (trains). On the CPU, nothing downloaded."""

import copy

import pytest
import torch

import ortbridge

transformers = pytest.importorskip("transformers")
nn = torch.nn


class Sentences(torch.utils.data.Dataset):
    """16 random token sequences with labels, the same at every run."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        generator = torch.Generator().manual_seed(i)
        return {
            "input_ids": torch.randint(0, 64, (8,), generator=generator),
            "attention_mask": torch.ones(8, dtype=torch.long),
            "labels": torch.tensor(i % 2),
        }


def _bert():
    from tiny_bert import tiny_bert_config

    config = tiny_bert_config(num_labels=2)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def _hugging_face_trainer(model, folder):
    """Trains 3 steps, evaluates; (training losses, evaluation loss)."""
    args = transformers.TrainingArguments(
        output_dir=str(folder),
        max_steps=3,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
        # (Trainer finds the label argument in the model's class: OrtModule's forward names none)
        label_names=["labels"],
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Sentences(), eval_dataset=Sentences())
    trainer.train()
    evaluation = trainer.evaluate()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], evaluation["eval_loss"]


def test_hugging_face_trainer_trains_evaluates_and_saves(tmp_path):
    pytest.importorskip("accelerate")
    model = _bert()
    eager = _hugging_face_trainer(copy.deepcopy(model), tmp_path / "eager")
    wrapped = ortbridge.OrtModule(model)
    ours = _hugging_face_trainer(wrapped, tmp_path / "ours")
    assert len(ours[0]) == 3 and ours[0] == pytest.approx(eager[0], rel=1e-5, abs=1e-6)
    assert ours[1] == pytest.approx(eager[1], rel=1e-5)
    assert wrapped._captures, "the Trainer did not call the OrtModule"
    # save_pretrained through the OrtModule (the wrapped model's); from_pretrained gives the trained model.
    wrapped.save_pretrained(tmp_path / "saved")
    loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "saved").eval()
    batch = Sentences()[3]
    inputs = {k: v[None] for k, v in batch.items() if k != "labels"}
    wrapped.eval()
    torch.testing.assert_close(loaded(**inputs).logits, wrapped(**inputs).logits, rtol=1e-5, atol=1e-6)


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


def test_lightning_module_with_a_wrapped_model_trains():
    lightning = pytest.importorskip("lightning")

    class Module(lightning.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, index):
            x, y = batch
            return (self.model(x) - y).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(24, 8, generator=generator), torch.randn(24, 1, generator=generator)
    )
    results = []
    for model in (Regression(), ortbridge.OrtModule(Regression())):
        trainer = lightning.Trainer(
            max_steps=3,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Module(model), torch.utils.data.DataLoader(data, batch_size=8))
        results.append(model)
    eager, wrapped = results
    assert wrapped._captures, "Lightning did not call the OrtModule"
    for (name, p), q in zip(eager.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
