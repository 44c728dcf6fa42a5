//! The macros that let each setting be declared once.
//!
//! Before them a setting was named in four places tied by string literals (the table entry,
//! the `Config` field, the rendering match and the construction of `Config`), so a mismatch was
//! found only at run time. [`settings!`] generates all four from one declaration, so adding a
//! setting is one edit and a misspelt or missing name cannot compile. [`word_enum!`] defines
//! the enums whose values are lowercase words in the environment.

/// Declares every setting, in the order of the docs and of `render_effective`. Each entry:
///
/// ```text
/// /// Extra documentation of the field (optional; the description is its first line).
/// field_name: FieldType = NAME {
///     default: "as written in the environment; empty = unset or derived",
///     allowed: Allowed::…,
///     secret: false,
///     render: |value: &FieldType| -> Option<String> { the value as written, None = unset },
///     description: "One line for docs/configuration.md.",
/// },
/// ```
///
/// It generates:
/// - `SETTINGS`, the table every generic walk reads (parsing, docs, `render_effective`);
/// - `Config`, one documented pub field per setting;
/// - `key::NAME`, a [`Key`](super::parse::Key) typed like the field, for the checks across
///   settings;
/// - `Config::from_values`, which moves each parsed value into its field;
/// - `Config::written_values`, each field rendered back, in table order.
///
/// Whether a setting's [`Allowed`](super::Allowed) parses into its field type is still checked
/// at run time (an internal error naming the setting); `tests/config.rs` sets every setting.
macro_rules! settings {
    ($(
        $(#[$meta:meta])*
        $field:ident: $ty:ty = $name:ident {
            default: $default:literal,
            allowed: $allowed:expr,
            secret: $secret:literal,
            render: $render:expr,
            description: $description:literal $(,)?
        }
    ),+ $(,)?) => {
        /// Every setting, in the order of the docs and of `render_effective`.
        pub const SETTINGS: &[Setting] = &[$(
            Setting {
                name: stringify!($name),
                default: $default,
                allowed: $allowed,
                description: $description,
                secret: $secret,
            },
        )+];

        /// The validated configuration: one field per entry of [`SETTINGS`]. Built only by
        /// [`Config::from_lookup`] / [`Config::from_env`] in production; fields are public so
        /// tests can adjust a parsed config.
        #[derive(Clone, PartialEq, Eq)]
        pub struct Config {
            $(
                #[doc = concat!("`", stringify!($name), "`: ", $description)]
                #[doc = ""]
                $(#[$meta])*
                pub $field: $ty,
            )+
            /// The librdkafka properties of each cluster of `KAFKA_CLUSTERS` that has them:
            /// `(name, properties)` read from `TASKBROKER_KAFKA_CLUSTER_<NAME>_CONFIG`, whose
            /// names depend on a setting's value, so they are not entries of the table. Secret.
            pub kafka_cluster_properties: Vec<(String, Vec<(String, String)>)>,
        }

        /// One [`Key`] per setting, typed like its `Config` field.
        pub(super) mod key {
            use super::*;

            $(pub const $name: Key<$ty> = Key::new(stringify!($name));)+
        }

        impl Config {
            /// Moves every parsed value into its field.
            pub(super) fn from_values(mut values: Values) -> Result<Self, ConfigError> {
                Ok(Config {
                    $($field: values.take(key::$name)?,)+
                    kafka_cluster_properties: values.take_cluster_properties(),
                })
            }

            /// Each setting's value as it would be written in the environment, in table
            /// order; `None` when unset.
            pub(super) fn written_values(&self) -> Vec<Option<String>> {
                vec![$({
                    let render: fn(&$ty) -> Option<String> = $render;
                    render(&self.$field)
                }),+]
            }
        }
    };
}

/// Defines an enum whose variants are spelled as lowercase words in the environment.
macro_rules! word_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$variant_meta:meta])* $variant:ident = $word:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$variant_meta])* $variant,)+
        }

        impl $name {
            /// The words accepted in the environment.
            pub const WORDS: &'static [&'static str] = &[$($word),+];

            /// The word for this value, as written in the environment.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $word,)+
                }
            }

            /// The value a word (as written in the environment, lower case) names.
            pub(crate) fn from_word(word: &str) -> Option<Self> {
                match word {
                    $($word => Some(Self::$variant),)+
                    _ => None,
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromValue for $name {
            fn from_value(value: Value) -> Option<Self> {
                match value {
                    Value::Word(word) => Self::from_word(word),
                    _ => None,
                }
            }
        }
    };
}

pub(super) use {settings, word_enum};
