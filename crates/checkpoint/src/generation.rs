//! A Hugging Face folder's `generation_config.json`: the ids that end a generation (Llama 3
//! lists three) and the sampling its authors recommend, which `tpctl serve` takes as the
//! defaults of fields a request leaves out (as vLLM does).

use crate::error::{Error, Result};
use serde_json::Value;
use std::path::Path;

/// What `generation_config.json` says that tpctl uses; `None` fields were not given.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    /// `eos_token_id`: one id or a list.
    pub eos: Vec<u32>,
    /// `temperature`.
    pub temperature: Option<f32>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `top_k`.
    pub top_k: Option<usize>,
    /// `repetition_penalty`.
    pub repetition_penalty: Option<f32>,
}

impl GenerationConfig {
    /// The `generation_config.json` of the model at `model`: `None` for a GGUF file or a folder
    /// without one.
    ///
    /// # Errors
    /// [`Error::Io`] when the file exists but cannot be read; [`Error::Metadata`] naming the
    /// file and key when it is not JSON or a field has the wrong type.
    pub fn load(model: &Path) -> Result<Option<GenerationConfig>> {
        let path = model.join("generation_config.json");
        if crate::Format::of(model) != crate::Format::HfFolder || !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            what: "reading",
            path: path.clone(),
            source,
        })?;
        GenerationConfig::parse(&text, &path.display().to_string()).map(Some)
    }

    /// Parses the file's text; `origin` names it in errors.
    ///
    /// # Errors
    /// As [`GenerationConfig::load`].
    pub fn parse(text: &str, origin: &str) -> Result<GenerationConfig> {
        let json: Value = serde_json::from_str(text)
            .map_err(|e| Error::metadata(origin, format!("not json: {e}")))?;
        let bad =
            |key: &str, want: &str| Error::metadata(&format!("{origin}: {key}"), want.to_owned());
        let id = |v: &Value| v.as_u64().and_then(|x| u32::try_from(x).ok());
        let eos = match json.get("eos_token_id") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(ids)) => ids
                .iter()
                .map(|v| id(v).ok_or_else(|| bad("eos_token_id", "expected token ids")))
                .collect::<Result<_>>()?,
            Some(v) => vec![id(v).ok_or_else(|| bad("eos_token_id", "expected a token id"))?],
        };
        let float = |key: &str| -> Result<Option<f32>> {
            match json.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => {
                    v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| bad(key, "expected a number"))
                }
            }
        };
        let top_k = match json.get("top_k") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| bad("top_k", "expected a count"))? as usize),
        };
        Ok(GenerationConfig {
            eos,
            temperature: float("temperature")?,
            top_p: float("top_p")?,
            top_k,
            repetition_penalty: float("repetition_penalty")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_and_their_errors() {
        let g = GenerationConfig::parse(
            r#"{"bos_token_id": 1, "eos_token_id": [128001, 128009], "do_sample": true,
                "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.45"}"#,
            "g.json",
        )
        .unwrap();
        assert_eq!(g.eos, [128001, 128009]);
        assert_eq!((g.temperature, g.top_p, g.top_k), (Some(0.6), Some(0.9), None));
        let one = GenerationConfig::parse(r#"{"eos_token_id": 2, "top_k": 20}"#, "g.json").unwrap();
        assert_eq!((one.eos, one.top_k), (vec![2], Some(20)));
        let e = GenerationConfig::parse(r#"{"temperature": "hot"}"#, "g.json").unwrap_err();
        assert!(e.to_string().contains("g.json: temperature"), "{e}");
        assert!(e.to_string().contains("expected a number"), "{e}");
        assert!(GenerationConfig::parse("{", "g.json").is_err());
        let dir = std::env::temp_dir().join(format!("tpctl-gencfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(GenerationConfig::load(&dir).unwrap(), None);
        std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": 7}"#).unwrap();
        assert_eq!(GenerationConfig::load(&dir).unwrap().unwrap().eos, [7]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
